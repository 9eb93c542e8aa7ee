"""`kvforge eval speed --engine vllm`: SPEED's reply loss with vLLM serving, beside kvforge's own on
the same held-out replies.

The reply loss of `eval speed`: a held-out conversation's assistant reply, given the conversation
before it, teacher forced, the reply rows full depth. In vLLM the whole conversation is one
request with prompt logprobs, and the model class plans only the prompt (`score_tokens`: the
reply's rows are decode-phase rows, outside the plan). Arms: exact (the same engine with SPEED
off) and SPEED, on the base weights and, with an adapter, on a second engine that merged it on
load. kvforge's engine scores the same samples under the same plans, so the report holds both
engines' gaps with paired-bootstrap intervals and, per arm, the largest per-token NLL difference
between vLLM and kvforge; and, per weight set, on how many samples both engines continue the
prompt with the same greedy tokens under SPEED.
"""

from __future__ import annotations

import itertools

import torch

from kvforge.data.replies import reply_samples
from kvforge.evaluate.metrics import mean_nll, paired_bootstrap_ci, ppl_gap_pct
from kvforge.fill.speed import SpeedConfig, speed_plan
from kvforge.fill.speed_fit import reply_nll, sample_plan
from kvforge.generation import GenerationConfig


def eval_vllm_speed(base, adapted, model_dir, speed: SpeedConfig, settings: dict, adapter: str | None, samples: int, max_tokens: int,
                    dtype, greedy_tokens: int = 32, progress=None) -> dict:
    """`base` (and `adapted`, with an adapter): kvforge's engines; `settings`: `engine_args`'
    SPEED keyword arguments for vLLM (the same policy as `speed`). Beside the loss, each sample's
    prompt is continued greedily for `greedy_tokens` by both engines under SPEED, and the
    report counts the samples whose tokens are equal."""
    from vllm import SamplingParams

    from kvforge.vllm.engine import close_llm, generate, start_llm
    from kvforge.vllm.speed import engine_args, set_speed

    chosen = list(itertools.islice(reply_samples(base.model.tokenizer, "held_out", max_tokens), samples))
    if len(chosen) < 2:
        raise ValueError(f"fewer than 2 held-out conversations fit in {max_tokens} tokens")
    weights = {"base": (base, {**settings, "adapter": None})}
    if adapted is not None:
        weights["adapted"] = (adapted, {**settings, "adapter": adapter})
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=greedy_tokens, ignore_eos=True)
    config = GenerationConfig(max_new_tokens=greedy_tokens, temperature=0.0, ignore_eos=True)
    same = {label: 0 for label in weights}
    nll: dict[str, list[torch.Tensor]] = {}
    for label, (engine, args) in weights.items():
        prefix = "" if label == "base" else "adapted_"
        # room for the longest sample and for the longest prompt's greedy continuation
        room = max_tokens + greedy_tokens + 16
        llm = start_llm(model_dir, dtype, **engine_args(**args, max_model_len=room), max_num_seqs=1)
        try:
            for i, sample in enumerate(chosen):
                if progress:
                    progress(f"{label} weights: reply {i + 1}/{len(chosen)} ({sample.prompt_tokens} prompt + {sample.reply_tokens} reply tokens)")
                for arm, policy in (("exact", None), ("speed", speed)):
                    with torch.inference_mode():
                        nll.setdefault(f"kvforge_{prefix}{arm}", []).append(reply_nll(engine, sample, sample_plan(engine, sample, policy)).cpu())
                    set_speed(llm, policy is not None, score_tokens=sample.reply_tokens)
                    out = generate(llm, [sample.ids], score)[0]
                    nll.setdefault(f"vllm_{prefix}{arm}", []).append(
                        torch.tensor([-out.prompt_logprobs[j][sample.ids[j]].logprob for j in range(sample.prompt_tokens, len(sample.ids))]))
                prompt = sample.ids[: sample.prompt_tokens]
                set_speed(llm, True, score_tokens=0)
                served = generate(llm, [prompt], greedy)[0].outputs[0].token_ids
                ours = engine.generate([prompt], config, plan=speed_plan(len(prompt), speed, engine.num_layers))[0].token_ids
                same[label] += list(served) == list(ours)
        finally:
            close_llm(llm)
    every = [torch.ones_like(x, dtype=torch.bool) for x in nll["kvforge_exact"]]
    arms = [name.removeprefix("kvforge_") for name in nll if name.startswith("kvforge_")]
    report = {
        "samples": len(chosen),
        "reply_tokens": sum(s.reply_tokens for s in chosen),
        "prompt_tokens_mean": sum(s.prompt_tokens for s in chosen) / len(chosen),
        "nll": {name: mean_nll(values, every) for name, values in nll.items()},
        "max_token_nll_diff": {arm: max(float((a - b).abs().max()) for a, b in zip(nll[f"vllm_{arm}"], nll[f"kvforge_{arm}"])) for arm in arms},
        "greedy_tokens": greedy_tokens,
        "greedy_equal": {("training_free" if label == "base" else "adapted"): n for label, n in same.items()},
        "policy_gap_pct": {},
        "policy_gap_ci": {},
    }
    for engine_name in ("vllm", "kvforge"):
        for label in weights:
            prefix = "" if label == "base" else "adapted_"
            speed_nll, exact_nll = nll[f"{engine_name}_{prefix}speed"], nll[f"{engine_name}_{prefix}exact"]
            key = f"{engine_name}_{'training_free' if label == 'base' else 'adapted'}"
            report["policy_gap_pct"][key] = ppl_gap_pct(speed_nll, exact_nll, every)
            report["policy_gap_ci"][key] = paired_bootstrap_ci(speed_nll, exact_nll, every)
    return report
