"""`kvforge models`, `generate`, `rollout`, `demo`: the engine answering prompts, exact or with a method."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvforge.cli.common import (
    AdapterOpt, AnchorsOpt, AttendedOpt, BudgetOpt, CutOpt, DeviceOpt, DraftOpt, DtypeOpt, HistoryEntriesOpt, JsonOpt, KMinOpt, KOpt, MapsOpt,
    ModelOpt, PrefetchOpt,
    PresetOpt, RescueOpt, SplitOpt, TailOpt, ThreadsOpt, app, dtype_of, emit_json, err, load_engine, read_prompt, setup_threads, user_errors,
)
from kvforge.errors import KvforgeError


@app.command()
@user_errors
def models(json_out: bool = JsonOpt):
    """List the packaged model aliases, where they come from and whether they are installed."""
    from kvforge.models import PACKAGED_MODELS

    rows = [
        {"alias": m.alias, "description": m.description, "packages": list(m.packages), "installed": m.installed(), "install": m.install}
        for m in PACKAGED_MODELS.values()
    ]
    if json_out:
        emit_json({"command": "models", "models": rows})
        return
    table = Table("alias", "installed", "what", "from (pip)")
    for r in rows:
        table.add_row(r["alias"], "yes" if r["installed"] else "no", r["description"], r["install"])
    Console().print(table)


@app.command()
@user_errors
def generate(
    model: str = ModelOpt,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", "-f", help="Read the prompt from a file."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", help="Prefill chunk (tokens)."),
    method: str = typer.Option("exact", "--method", help="Prefill method: exact, ridgefill or speed."),
    maps: Optional[Path] = MapsOpt,
    preset: str = PresetOpt,
    split: Optional[int] = SplitOpt,
    tail: Optional[int] = TailOpt,
    exact_rows: Optional[str] = typer.Option(None, "--exact-rows", help="RidgeFill: prompt positions kept exact, comma-separated."),
    attended_rows: Optional[int] = AttendedOpt,
    rescue: bool = RescueOpt,
    cut: Optional[str] = CutOpt,
    anchors: Optional[str] = AnchorsOpt,
    adapter: Optional[Path] = AdapterOpt,
    draft: str = DraftOpt,
    prefetch: bool = PrefetchOpt,
    k: int = KOpt,
    budget: int = BudgetOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Generate a completion: exact prefill, RidgeFill (late layers filled from ridge maps) or
    SPEED (prompt rows cached only below the cut; decode runs full depth); decoding plain or
    speculative with a lossless drafter."""
    from kvforge.fill import ridgefill, speed
    from kvforge.generation import GenerationConfig
    from kvforge.plan import PrefillReport
    from kvforge.prompting import encode_prompt
    from kvforge.speculative.rollout import DraftConfig, generate_group

    setup_threads(threads)
    if (prompt is None) == (prompt_file is None):
        raise KvforgeError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else read_prompt(prompt_file)
    if not text.strip():
        raise KvforgeError("empty prompt: give some text")
    config = GenerationConfig(max_new_tokens, temperature, top_k, top_p, seed, tuple(stop), chunk_size=chunk_size)
    if method not in ("exact", "ridgefill", "speed"):
        raise KvforgeError(f"unknown --method {method!r}: use exact, ridgefill or speed")
    if adapter is not None and method != "speed":
        raise KvforgeError(f"--adapter is a SPEED adapter: use it with --method speed, not {method}")
    drafting = DraftConfig(draft, k, prefetch, budget)
    engine = load_engine(model, device, dtype)
    ids = encode_prompt(engine.model.tokenizer, text, chat=chat)
    plan, setting = None, None
    if method == "ridgefill":
        rf, resident = ridgefill.resolve(engine, maps, preset, split, tail, attended_rows, _parse_rows(exact_rows), rescue=rescue)
        plan, setting = ridgefill.ridgefill_plan(engine, ids, rf, resident), asdict(rf)
    elif method == "speed":
        spd = speed.resolve(engine, cut, anchors, tail, adapter)
        engine, plan, setting = spd.engine, spd.plan(len(ids)), asdict(spd.config)
    ran = PrefillReport.planned(plan, len(ids), engine.num_layers)
    if ran.reason and method != "exact":
        err.print(f"[yellow]note:[/yellow] {ran.reason}; running exact prefill", highlight=False, soft_wrap=True)
    stream = None if json_out else (lambda _i, delta: (sys.stdout.write(delta), sys.stdout.flush()))
    outputs, stats = generate_group(engine, ids, 1, config, drafting, on_text=stream, plan=plan)
    out = outputs[0]
    ran = out.prefill or ran  # read off the cache: the rows an attended-row chooser picked are known now
    if json_out:
        emit_json(
            {
                "command": "generate",
                "model": model,
                "method": method,
                "dtype": dtype_of(engine),
                **{key: value for key, value in ran.as_dict().items() if key != "prompt_tokens"},  # what the prefill ran
                "setting": setting,
                "tokens": out.prompt_tokens,
                "prompt_tokens": out.prompt_tokens,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "ttft_s": out.ttft_s,
                "decode_tokens_per_s": out.decode_tokens_per_s,
                "rescued_rows": out.rescued_rows,  # RidgeFill: filled rows recomputed while decoding
                "adapter": str(adapter) if adapter else None,
                "draft": draft,
                "speculative": stats.as_dict() if stats else None,
            }
        )
    else:
        sys.stdout.write("\n")
        err.print(
            f"[dim]{out.prompt_tokens} prompt tokens, {len(out.token_ids)} generated, TTFT {out.ttft_s:.3f} s, "
            f"{out.decode_tokens_per_s:.1f} tokens/s, finish: {out.finish_reason}"
            + (f", {draft} drafting: mean accept length {stats.mean_accept_len:.2f} of {k}" if stats else "")
            + (f", prefetch coverage {stats.coverage:.2f}" if stats and prefetch else "")
            + "[/dim]"
        )


def _parse_rows(text: Optional[str]) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in (text or "").split(",") if t.strip())
    except ValueError as exc:
        raise KvforgeError(f"--exact-rows takes comma-separated token positions, got {text!r}") from exc


@app.command()
@user_errors
def rollout(
    model: str = ModelOpt,
    prompts: Path = typer.Option(..., "--prompts", help="Prompts: .jsonl with a \"prompt\" field per line, or text with one prompt per line."),
    samples_per_prompt: int = typer.Option(8, "--samples-per-prompt", "-G", help="Samples per prompt (one batch, one shared n-gram cache)."),
    temperature: float = typer.Option(1.0, "--temperature", "-t"),
    top_p: float = typer.Option(1.0, "--top-p"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    epoch: int = typer.Option(
        0, "--epoch", min=0,
        help="The RL epoch: part of every sampled token's noise key, so one --seed draws fresh noise each epoch.",
    ),
    couple_epochs: bool = typer.Option(
        False, "--couple-epochs",
        help="Leave the epoch out of the noise key: a sample replays its previous rollout wherever the policy agrees. "
        "Faster drafting, but not a fresh draw from the current policy (docs/ngram.md).",
    ),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Wrap each prompt in the model's chat template."),
    draft: str = typer.Option("ngram", "--draft", help="none, prompt-lookup or ngram."),
    prefetch: bool = PrefetchOpt,
    k: int = KOpt,
    budget: int = BudgetOpt,
    no_gate: bool = typer.Option(False, "--no-gate", help="Verify every draft found (no gate weighing its acceptance against the cost of a wider step)."),
    history: Optional[Path] = typer.Option(
        None, "--history",
        help="Per-prompt rollout history directory (one file per prompt; needs --draft ngram): the next call drafts from these rollouts.",
    ),
    history_entries: int = HistoryEntriesOpt,
    k_min: Optional[int] = KMinOpt,
    model_logprobs: bool = typer.Option(
        False, "--model-logprobs",
        help="Also write model_logprobs: each token's log-probability under the unmodified model distribution (temperature 1, no top-p).",
    ),
    out: Path = typer.Option(Path("rollouts.jsonl"), "--out", "-o", help="JSONL of rollouts, one line per sample, with sampling_logprobs."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """RL-style rollouts: G samples per prompt, decoded together, plain or with a lossless drafter.
    Each JSONL line holds a sample's token ids, text and sampling_logprobs: each token's
    log-probability under the distribution it was sampled from (after temperature and top-p;
    0.0 when greedy), plus model_logprobs with --model-logprobs. With --draft ngram each prompt's
    n-gram cache is its rollout history: kept across the prompts of this call, and with --history
    across calls, with each sample's latest rollout (sample i drafts from the last call's sample
    i first)."""
    import time

    from kvforge.generation import GenerationConfig
    from kvforge.prompting import encode_prompt
    from kvforge.speculative.history import RolloutHistory
    from kvforge.speculative.rollout import DraftConfig, generate_group
    from kvforge.speculative.step import SpecStats

    setup_threads(threads)
    if samples_per_prompt < 1:
        raise KvforgeError("--samples-per-prompt must be >= 1")
    texts = _read_prompts(prompts)
    drafting = DraftConfig(draft, k, prefetch, budget, gate=not no_gate, k_min=k_min)
    if history is not None and draft != "ngram":
        raise KvforgeError("--history needs --draft ngram: the history is the prompts' n-gram caches")
    store = RolloutHistory(drafting.n_min, drafting.n_max, history_entries, history,
                           warn=lambda m: err.print(f"[yellow]warning:[/yellow] {m}", highlight=False, soft_wrap=True))
    config = GenerationConfig(max_new_tokens, temperature, 0, top_p, seed, logprobs=True, epoch=0 if couple_epochs else epoch)
    engine = load_engine(model, device, dtype)
    engine.release_unpacked_weights()  # bf16 with the kernels: the weights kept packed only
    encoded = [encode_prompt(engine.model.tokenizer, t, chat=chat) for t in texts]
    tokens, total, start = 0, SpecStats(drafting.k), time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for index, ids in enumerate(encoded):
            err.print(f"[dim]prompt {index + 1}/{len(encoded)}: {len(ids)} tokens x{samples_per_prompt}[/dim]")
            outputs, stats = generate_group(engine, ids, samples_per_prompt, config, drafting, history=store)
            for sample, g in enumerate(outputs):
                f.write(json.dumps(_rollout_record(index, sample, g, model_logprobs)) + "\n")
                tokens += len(g.token_ids)
            if stats:
                total.add(stats)
    elapsed = time.perf_counter() - start
    summary = {
        "command": "rollout",
        "model": model,
        "method": draft,
        "dtype": dtype_of(engine),
        "gate": drafting.gate,
        "k_min": k_min,
        "history": str(history) if history is not None else None,
        "tokens": tokens,
        "prompts": len(encoded),
        "samples_per_prompt": samples_per_prompt,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "mean_accept_len": total.mean_accept_len if total.request_steps else None,
        "epoch": config.epoch,  # the epoch in the noise key (0 with --couple-epochs)
        "noise": "coupled" if couple_epochs else "keyed by epoch",
        "accept_by_source": total.accept_by_source,
        "out": str(out),
    }
    if json_out:
        emit_json(summary)
        return
    err.print(f"wrote {len(encoded) * samples_per_prompt} rollouts to {out}: {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s)")


def _rollout_record(prompt_index: int, sample: int, g, model_logprobs: bool) -> dict:
    """One JSONL line: `sampling_logprobs` are under the distribution each token was drawn from
    (what an importance ratio needs), `model_logprobs` under the raw model distribution."""
    record = {"prompt_index": prompt_index, "sample": sample, "text": g.text, "token_ids": g.token_ids, "finish_reason": g.finish_reason,
              "sampling_logprobs": [lp.sampling for lp in g.logprobs]}
    if model_logprobs:
        record["model_logprobs"] = [lp.model for lp in g.logprobs]
    return record


def _read_prompts(path: Path) -> list[str]:
    """Prompts from .jsonl ({"prompt": ...} per line) or plain text (one per non-empty line)."""
    text = read_prompt(path)
    if path.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise KvforgeError(f"{path}:{number}: expected a JSON object with a \"prompt\" string") from exc
            if not isinstance(prompt, str) or not prompt.strip():
                raise KvforgeError(f"{path}:{number}: empty prompt")
            prompts.append(prompt)
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise KvforgeError(f"{path} holds no prompts")
    return prompts


@app.command()
@user_errors
def demo(
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """A long held-out conversation answered by every method, then one closing line per method."""
    from kvforge.artifacts import default_translator_path, find_artifact
    from kvforge.demo import EXTRACT_QUESTION, PARTNERS, closing_lines, degeneration, shared_content_words, timed_demo

    started = time.perf_counter()
    setup_threads(threads)
    engine = load_engine(model, device, dtype)
    maps = find_artifact("maps", engine.model.name)
    if not maps.is_file():
        err.print(f"[dim]first run: fitting RidgeFill maps for {model} once (a few minutes), cached in {maps}[/dim]")
    partner = PARTNERS.get(engine.model.name)
    translator = default_translator_path(partner, engine.model.name) if partner else None
    if translator is not None and not translator.is_file():
        err.print(f"[dim]first run: fitting a KV-Lingo translator {partner} → {model} once (a few minutes), cached in {translator}[/dim]")
    with err.status("answering") as status:
        rows, prompt, answer_s = timed_demo(engine, max_new_tokens, progress=lambda name: status.update(f"answering: {name}"))
    wall_s = time.perf_counter() - started
    checks = [{"degenerate": degeneration(r.answer), "shared_with_exact": len(shared_content_words(r.answer, rows[0].answer))} for r in rows]
    if json_out:
        emit_json(
            {
                "command": "demo",
                "model": model,
                "method": ",".join(r.method for r in rows),
                "dtype": dtype_of(engine),
                "tokens": rows[0].prompt_tokens,
                "wall_s": wall_s,
                "answer_s": answer_s,
                "results": [r.__dict__ | c for r, c in zip(rows, checks)],
                "closing": closing_lines(rows),
            }
        )
        return
    out = Console()
    out.print(f"[bold]kvforge demo[/bold] on {model}: a held-out ShareGPT conversation, then {prompt.splitlines()[-1]!r} "
              f"(n-gram drafting: {EXTRACT_QUESTION!r})")
    table = Table("method", "prompt tokens", "TTFT s", "decode tok/s")
    for r in rows:
        table.add_row(r.method, str(r.prompt_tokens), f"{r.ttft_s:.2f}", f"{r.decode_tokens_per_s:.1f}")
    out.print(table)
    for r, c in zip(rows, checks):
        answer = r.answer[:400] + ("…" if len(r.answer) > 400 else "")
        flag = f" [red](repeats {c['degenerate']!r})[/red]" if c["degenerate"] else ""
        out.print(f"[bold]{r.method}[/bold]{flag}: {answer}", highlight=False)
    out.print()
    for line in closing_lines(rows):
        out.print(line, highlight=False)
    out.print(f"[dim]{wall_s:.0f} s in all: {wall_s - answer_s:.0f} s loading, {answer_s:.0f} s answering[/dim]")
