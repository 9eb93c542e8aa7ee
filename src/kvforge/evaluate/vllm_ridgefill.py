"""`kvforge eval ridgefill --engine vllm`: RidgeFill's quality with vLLM serving, beside kvforge's
own figures on the same samples.

Continuation loss, as `eval ridgefill` computes it: a held-out sequence of prompt + continuation
tokens; the prompt minus its last token is the context RidgeFill fills, and the continuation is
scored over it. In vLLM the whole sequence is one request with prompt logprobs, and the model class
plans only the context (`score_tokens`: the last prompt token and the continuation are exact and
outside the plan); the exact arm is the same engine with RidgeFill off. kvforge's engine scores the
same sequences both ways (`scoring.continuation_nll` over its exact and RidgeFill caches), so the
report holds both gaps with their paired-bootstrap intervals, and the largest per-token NLL
difference between vLLM's and kvforge's RidgeFill.

Both engines score a continuation without the decode-time rescue: vLLM scores it as prompt rows,
where no decode step runs.

Needles: RULER niah_single haystacks, greedy answers, vLLM with RidgeFill on and off and kvforge's
RidgeFill, both decoding with the rescue unless `config.rescue` is None (then vLLM's RidgeFill also
answers without it); per arm the needles whose rows were all filled, how many of those were
answered, and the rows the rescue recomputed.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from kvforge.data.prompts import token_sequences
from kvforge.data.tasks import answered, needle_sample
from kvforge.evaluate.metrics import paired_bootstrap_ci, ppl_gap_pct, token_classes
from kvforge.evaluate.ridgefill import NEEDLE_CONFIG, EvalSettings
from kvforge.fill.ridgefill import ridgefill_plan
from kvforge.plan import final_depth
from kvforge.scoring import continuation_nll


def eval_vllm_ridgefill(engine, model_dir, maps_path, maps, config, settings: EvalSettings, dtype, progress=None) -> dict:
    from vllm import SamplingParams

    from kvforge.vllm.engine import close_llm, generate, start_llm
    from kvforge.vllm.ridgefill import engine_args, set_ridgefill

    longest = max(settings.prompt_tokens + settings.continuation, settings.needle_tokens + NEEDLE_CONFIG.max_new_tokens) + 16
    choice = {"split": config.split, "tail": config.tail, "attended_rows": config.attended_rows, "sinks": config.sinks,
              "rescue": asdict(config.rescue) if config.rescue is not None else False}
    llm = start_llm(model_dir, dtype, **engine_args(maps_path, max_model_len=longest, **choice), max_num_seqs=1)
    nll = {name: [] for name in ("vllm_exact", "vllm_ridgefill", "kvforge_exact", "kvforge_ridgefill")}
    novel, key, filled_agree = [], [], True
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    try:
        sequences = token_sequences(engine.model.tokenizer, settings.prompt_tokens + settings.continuation, "held_out")
        for i in range(settings.samples):
            seq = next(sequences)
            if progress:
                progress(f"continuation sample {i + 1}/{settings.samples}")
            context = seq[: settings.prompt_tokens - 1]
            with torch.inference_mode():
                exact_cache = engine.prefill([context], logits="none")[1]
                _, ridge_cache = engine.prefill([context], plan=ridgefill_plan(engine, context, config, maps))
                nll["kvforge_exact"].append(continuation_nll(engine, seq, settings.prompt_tokens, exact_cache).cpu())
                nll["kvforge_ridgefill"].append(continuation_nll(engine, seq, settings.prompt_tokens, ridge_cache).cpu())
            for name, on in (("vllm_exact", False), ("vllm_ridgefill", True)):
                set_ridgefill(llm, on, score_tokens=len(seq) - len(context))
                out = generate(llm, [seq], score)[0]
                nll[name].append(torch.tensor([-out.prompt_logprobs[j][seq[j]].logprob for j in range(settings.prompt_tokens, len(seq))]))
            record = _record(llm, len(seq))
            filled = ~record.exact.cpu()[: len(context)]
            filled_agree &= bool(torch.equal(filled, final_depth(ridge_cache, len(context)) < engine.num_layers))
            n, k = token_classes(seq, settings.prompt_tokens, filled)
            novel.append(n)
            key.append(k)
        needle = _needles(engine, llm, maps, config, settings, progress)
    finally:
        set_ridgefill(llm, True, score_tokens=0)
        close_llm(llm)
    every = [torch.ones_like(m) for m in novel]
    gaps = {}
    for engine_name in ("vllm", "kvforge"):
        ridge, exact = nll[f"{engine_name}_ridgefill"], nll[f"{engine_name}_exact"]
        gaps[engine_name] = {
            "ppl_gap_novel_pct": ppl_gap_pct(ridge, exact, novel),
            "ppl_gap_novel_ci": paired_bootstrap_ci(ridge, exact, novel),
            "ppl_gap_key_pct": ppl_gap_pct(ridge, exact, key),
            "ppl_gap_key_ci": paired_bootstrap_ci(ridge, exact, key),
            "ppl_gap_all_pct": ppl_gap_pct(ridge, exact, every),
            "ppl_gap_all_ci": paired_bootstrap_ci(ridge, exact, every),
        }
    return {
        "gaps": gaps,
        "max_token_nll_diff_ridgefill": max(float((a - b).abs().max()) for a, b in zip(nll["vllm_ridgefill"], nll["kvforge_ridgefill"])),
        "max_token_nll_diff_exact": max(float((a - b).abs().max()) for a, b in zip(nll["vllm_exact"], nll["kvforge_exact"])),
        "same_filled_rows": filled_agree,
        "novel_tokens": int(sum(int(m.sum()) for m in novel)),
        "key_tokens": int(sum(int(m.sum()) for m in key)),
        "all_tokens": int(sum(m.numel() for m in every)),
        "needle": needle,
    }


def _needles(engine, llm, maps, config, settings: EvalSettings, progress) -> dict:
    from vllm import SamplingParams

    from kvforge.vllm.engine import generate
    from kvforge.vllm.ridgefill import ridgefill_stats, set_ridgefill

    params = SamplingParams(temperature=0.0, max_tokens=NEEDLE_CONFIG.max_new_tokens)
    rescuing = config.rescue is not None
    # (RidgeFill on, its rescue on) per vLLM arm; without the rescue as an arm of its own when it runs
    vllm_arms = {"vllm_exact": (False, False), "vllm_ridgefill": (True, rescuing)}
    if rescuing:
        vllm_arms["vllm_ridgefill_no_rescue"] = (True, False)
    arms = (*vllm_arms, "kvforge_ridgefill")
    correct = {name: 0 for name in arms}
    filled = {name: 0 for name in arms[1:]}
    filled_correct = {name: 0 for name in arms[1:]}
    rescued_rows = {name: 0 for name in arms[1:]}
    for i in range(settings.needles):
        depth = settings.needle_depths[i % len(settings.needle_depths)]
        reach = depth * max(0.0, 1.0 - config.tail / settings.needle_tokens)  # before the tail, as `eval ridgefill`
        sample = needle_sample(engine.model.tokenizer, settings.needle_tokens, reach, seed=i)
        if progress:
            progress(f"needle {i + 1}/{settings.needles} at depth {depth:.2f} of the rows before the tail")
        start, end = sample.needle_rows
        texts, wholly = {}, {}
        for name, (on, rescue) in vllm_arms.items():
            set_ridgefill(llm, on, score_tokens=0, rescue=rescue)
            before = ridgefill_stats(llm)[0].rescued_rows
            texts[name] = generate(llm, [sample.prompt], params)[0].outputs[0].text
            if on:
                record = _record(llm, len(sample.prompt))
                wholly[name] = bool((~record.exact.cpu()[start:end]).all())
                rescued_rows[name] += ridgefill_stats(llm)[0].rescued_rows - before
        set_ridgefill(llm, True, score_tokens=0, rescue=True)
        cache = engine.new_cache(1, capacity=len(sample.prompt) + NEEDLE_CONFIG.max_new_tokens)
        plan = ridgefill_plan(engine, sample.prompt, config, maps)
        ours = engine.generate(sample.prompt, NEEDLE_CONFIG, plan=plan, cache=cache)[0]
        texts["kvforge_ridgefill"] = ours.text
        rescued_rows["kvforge_ridgefill"] += ours.rescued_rows or 0
        wholly["kvforge_ridgefill"] = bool((final_depth(cache, len(sample.prompt)) < engine.num_layers)[start:end].all())
        for name in arms:
            ok = answered(texts[name], sample.value)
            correct[name] += ok
            if name in filled:
                filled[name] += wholly[name]
                filled_correct[name] += ok and wholly[name]
    n = settings.needles
    pct = lambda count, total: 100.0 * count / total if total else None  # noqa: E731
    return {
        "samples": n,
        **{name: pct(c, n) for name, c in correct.items()},
        "filled": filled,
        "answered_in_filled": filled_correct,
        "in_filled_pct": {name: pct(filled_correct[name], filled[name]) for name in filled},
        "rescued_rows": rescued_rows,  # filled rows the decode-time rescue recomputed, over every needle
    }


def _record(llm, tokens: int):
    """vLLM's record of the prefill just run, checked to be that prompt's."""
    from kvforge.vllm.ridgefill import ridgefill_stats

    record = ridgefill_stats(llm)[0].last[0]
    if record.tokens != tokens:
        raise RuntimeError(f"vLLM's last RidgeFill record is for {record.tokens} tokens, not this {tokens}-token prompt")
    return record
