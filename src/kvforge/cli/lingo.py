"""`kvforge fit lingo`, `handoff`, `eval lingo`, `bench lingo`: KV-Lingo on the command line. No algorithm lives here."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvforge.cli.common import (
    DeviceOpt, DtypeOpt, ReferenceDtypeOpt, JsonOpt, ThreadsOpt, app, bench_app, dtype_of, emit_json, err, eval_app, fit_app, load_engine, parse_lengths,
    read_prompt, figure_name, safe_name, setup_threads, user_errors,
)
from kvforge.errors import KvforgeError


SourceOpt = typer.Option("gemma3-270m", "--source", help="Model whose cache is translated.")
TargetOpt = typer.Option("smollm2-135m", "--target", help="Model that decodes from the translated cache.")
NativeTailOpt = typer.Option(0, "--native-tail", help="The text's last N tokens the target prefills itself, attending to the translated rows (the newest message, say); 0: every row but the head translated.")
TranslatorOpt = typer.Option(None, "--translator", help="Translator from `kvforge fit lingo` (default: the pair's cached stage-2 one when there is one, else its stage-1 one).")


def _translator(path: Optional[Path], source: str, target: str):
    from kvforge.artifacts import default_translator_path
    from kvforge.translate.translator import Translator

    return Translator.load(path or default_translator_path(source, target))


@fit_app.command("lingo")
@user_errors
def fit_lingo_cmd(
    source: str = SourceOpt,
    target: str = TargetOpt,
    assign: str = typer.Option("r2", "--assign", help="Layer assignment: identity, depth, greedy or r2 (the ν source layers that each fit the target layer best alone)."),
    nu: int = typer.Option(5, "--nu", help="Source layers per target layer."),
    capture: str = typer.Option("pre-norm", "--capture", help="Key capture point: pre-norm, post-norm or post-rope."),
    align_rule: str = typer.Option("cover", "--align", help="Cross-tokenizer rule: cover, last or mean."),
    head_wise: bool = typer.Option(False, "--head-wise", help="Block-diagonal maps, head h from head h (equal KV heads only)."),
    own_tokens: int = typer.Option(2, "--own-tokens", help="The target's own token embeddings (row t, t-1, ...) each map also reads (0-4; 0 with --head-wise)."),
    conversations: int = typer.Option(320, "--conversations", help="Fit conversations (plain text; 320: ~50 min on 2 CPU cores for gemma3-270m → smollm2-135m)."),
    max_chars: int = typer.Option(4000, "--max-chars", help="Characters per conversation."),
    lam: float = typer.Option(0.0, "--lam", help="Ridge λ relative to the mean input variance (0: eigen-truncation only)."),
    stage: int = typer.Option(1, "--stage", help="1: closed form; 2: self-distillation from --init."),
    init: Optional[Path] = typer.Option(None, "--init", help="Stage 2: the stage-1 translator to start from."),
    steps: int = typer.Option(100, "--steps", help="Stage 2 optimizer steps."),
    lr: float = typer.Option(3e-5, "--lr", help="Stage 2 peak learning rate (cosine, 5 % warmup)."),
    accumulate: int = typer.Option(8, "--accumulate", help="Stage 2 conversations per step."),
    samples: Optional[int] = typer.Option(None, "--samples", help="Stage 2 training conversations (default 128; with --stream: steps x accumulate, not given)."),
    layer_weight: float = typer.Option(0.0, "--layer-weight", help="Stage 2: add this weight times the translated keys' and values' squared error against the target's own rows (every layer, relative to their mean square) to the KL; 0: the KL alone."),
    stream: bool = typer.Option(False, "--stream", help="Stage 2: new conversations at every step, each read once and prepared when its step comes, instead of --samples conversations round and round."),
    recall_fraction: float = typer.Option(0.5, "--recall-fraction", help="Stage 2: share of samples that plant a fact early and ask it at the end (training facts, none of the QA set's; 0: the natural/packed mix alone)."),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="Stage 2 checkpoint file (resumed when it exists)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Stage 2: loss/validation-KL PNG (default: benchmarks/results/lingo-distill-<source>-to-<target>.png)."),
    validate_every: int = typer.Option(25, "--validate-every", help="Stage 2: steps between validation KLs (and checkpoints)."),
    heldout_every: int = typer.Option(0, "--heldout-every", help="Stage 2: steps between held-out bits per byte of the target from translated caches (held-out conversations past the 96 eval lingo --samples 96 scores; 0: none): the learning curve."),
    heldout_samples: int = typer.Option(96, "--heldout-samples", help="Stage 2: held-out conversations each --heldout-every scores."),
    residual: int = typer.Option(0, "--residual", help="Stage 2: train a nonlinear residual branch of this width beside each map (its output starts at zero; 0: linear maps only)."),
    pause_at: Optional[int] = typer.Option(None, "--pause-at", help="Stage 2: stop at this step, writing the translator, JSON and checkpoint as of it; rerun with the same --checkpoint to go on (a long run in pieces)."),
    train_native_tail: int = typer.Option(0, "--native-tail", help="Stage 2: train for hand-offs whose last N prefix tokens the target prefills itself (as handoff/eval/serve --native-tail); 0: every row but the head translated."),
    snapshots: Optional[str] = typer.Option(None, "--snapshots", help="Stage 1: conversation counts below --conversations (e.g. 32,96) at which a translator is also written (<out>-<n>conv.safetensors): the data curve from one pass."),
    save_moments: Optional[Path] = typer.Option(None, "--save-moments", help="Stage 1: also write the accumulated float64 moments (about 1 GB for this pair) to solve other assignments later."),
    moments: Optional[Path] = typer.Option(None, "--moments", help="Stage 1: solve from moments written by --save-moments instead of prefilling (capture, alignment, own tokens and data come from the file)."),
    lr_sweep: bool = typer.Option(False, "--lr-sweep", help="Stage 2: short runs (--steps each) at five rates half a decade apart around --lr, extended at the edges; picks the rate, writes no translator."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output .safetensors (default: $KVFORGE_HOME/translators/<source>-to-<target>.safetensors)."),
    device: str = DeviceOpt,
    dtype: str = ReferenceDtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Stage 1: closed-form KV-cache translator from SOURCE to TARGET (float64 moments, eigen-solve)."""
    from tqdm import tqdm

    from kvforge.artifacts import artifact_path
    from kvforge.translate.fit import LingoFitConfig, LingoMoments, fit_lingo
    from kvforge.translate.translator import ModelSide

    setup_threads(threads)
    if stage == 2 and (snapshots or save_moments or moments):
        raise KvforgeError("--snapshots, --save-moments and --moments are stage-1 options (closed form); stage 2 starts from --init")
    if stage != 2 and train_native_tail:
        raise KvforgeError("--native-tail is a stage-2 option: the closed form fits every aligned row, whatever a hand-off later prefills natively")
    if stage != 2 and heldout_every:
        raise KvforgeError("--heldout-every is a stage-2 option: the closed form has no steps")
    if stage != 2 and residual:
        raise KvforgeError("--residual is a stage-2 option: the closed form is linear")
    if stage != 2 and stream:
        raise KvforgeError("--stream is a stage-2 option: the closed form reads --conversations")
    if stage != 2 and layer_weight:
        raise KvforgeError("--layer-weight is a stage-2 option: the closed form fits the layers' rows alone")
    if stage == 2:
        if heldout_every < 0 or heldout_samples < 1:
            raise KvforgeError("--heldout-every must be >= 0 and --heldout-samples >= 1")
        if pause_at is not None and (pause_at < 1 or checkpoint is None):
            raise KvforgeError("--pause-at needs a step >= 1 and a --checkpoint to go on from")
        return _fit_stage2(source, target, init, steps, lr, accumulate, samples, recall_fraction, checkpoint, lr_sweep, validate_every, out, plot,
                           device, dtype, json_out, train_native_tail, heldout_every, heldout_samples, pause_at, residual, stream, layer_weight)
    if stage != 1:
        raise KvforgeError(f"--stage must be 1 or 2, got {stage}")
    config = LingoFitConfig(capture=capture, align=align_rule, assign=assign, nu=nu, head_wise=head_wise, conversations=conversations, max_chars=max_chars, lam=lam,
                            own_tokens=own_tokens)
    out = out or artifact_path("translator", source, target=target)
    counts = _counts(snapshots, conversations) if snapshots else []
    if moments is not None:
        if counts or save_moments:
            raise KvforgeError("--moments solves from saved moments: --snapshots and --save-moments need a fit that prefills")
        saved = LingoMoments.load(moments)
        src, tgt = load_engine(source, device, dtype), load_engine(target, device, dtype)  # to check the pair's fingerprints
        translator, written, dtype_name = saved.solve(ModelSide.of(src), ModelSide.of(tgt), config), [], saved.dtype
    else:
        src, tgt = load_engine(source, device, dtype), load_engine(target, device, dtype)
        dtype_name, written = dtype_of(tgt), []

        def write_snapshot(count: int, snapshot) -> None:
            written.append(_fit_summary(snapshot, snapshot.save(out.with_name(f"{out.stem}-{count}conv{out.suffix}"))))

        with tqdm(total=conversations, unit="conv", desc=f"{source} → {target}", file=sys.stderr, disable=json_out and not sys.stderr.isatty()) as bar:

            def progress(rows: int) -> None:
                bar.set_postfix(rows=rows)
                bar.update(1)

            translator, kept = fit_lingo(src, tgt, config, progress, tuple(counts), write_snapshot, keep_moments=True)
        if save_moments:
            kept.save(save_moments)
    path = translator.save(out)
    summary = {"command": "fit lingo", "model": target, "source": source, "target": target, "method": "lingo", "dtype": dtype_name,
               **_fit_summary(translator, path)}
    if written:
        summary["snapshots"] = written
    if save_moments:
        summary["moments"] = str(save_moments)
    if json_out:
        emit_json(summary)
        return
    err.print(
        f"wrote {path}: {source} → {target}, {translator.assign} ν={translator.nu}, {translator.capture}, {translator.align}, "
        f"own tokens {translator.own_tokens}, {summary['tokens']} rows in "
        f"{summary['seconds']:.0f} s; fit R² keys {summary['r2_fit_keys_mean']:.3f}, values {summary['r2_fit_values_mean']:.3f}"
    )


def _counts(text: str, conversations: int) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise KvforgeError(f"--snapshots must be comma-separated conversation counts, got {text!r}") from exc
    if not counts or not all(0 < n < conversations for n in counts):
        raise KvforgeError(f"--snapshots must list conversation counts between 0 and --conversations ({conversations}), got {text!r}")
    return counts


def _fit_summary(translator, path: Path) -> dict:
    r2 = translator.info["r2_fit"]
    return {
        "tokens": translator.info["fit"]["tokens"], "out": str(path), "seconds": translator.info["seconds"],
        "r2_fit_keys_mean": sum(r2["k"]) / len(r2["k"]), "r2_fit_values_mean": sum(r2["v"]) / len(r2["v"]),
        "sources": translator.sources, "macs_per_token": translator.macs_per_token(), **translator.info["fit"],
    }


VALIDATION_SKIP = 2000  # stage-2 validation: fit conversations from this one on
HELDOUT_CURVE_SKIP = 96  # stage-2 held-out curve: held-out conversations from this one on


def _fit_stage2(source, target, init, steps, lr, accumulate, samples, recall_fraction, checkpoint, lr_sweep, validate_every, out, plot, device, dtype, json_out,
                native_tail=0, heldout_every=0, heldout_samples=96, pause_at=None, residual=0, stream=False, layer_weight=0.0):
    from tqdm import tqdm

    from kvforge.translate.distill import DistillConfig, PreparedOnUse, distill, half_decade_rates, prepare, sweep_learning_rates
    from kvforge.translate.samples import iter_training_texts, training_texts
    from kvforge.artifacts import translator_stage2_path
    from kvforge.translate.translator import ModelSide, Translator

    if init is None:
        raise KvforgeError("--stage 2 needs --init: the stage-1 translator to start from")
    translator = Translator.load(init)
    if translator.residual and residual not in (0, translator.residual):
        raise KvforgeError(f"--init {init} has a residual branch of width {translator.residual}, not --residual {residual}")
    if residual and translator.head_wise:
        raise KvforgeError("--residual needs a head-mixing translator (it reads every source head); --init is head-wise")
    residual = residual or translator.residual  # an init with a branch goes on training it
    if stream and lr_sweep:
        raise KvforgeError("--lr-sweep runs its short runs over one fixed set of samples: leave out --stream")
    if stream and samples is not None:
        raise KvforgeError("--stream reads steps x accumulate samples: leave out --samples")
    samples = steps * accumulate if stream else (128 if samples is None else samples)
    config = DistillConfig(steps=steps, lr=lr, accumulate=accumulate, samples=samples, recall_fraction=recall_fraction, validate_every=validate_every, checkpoint_every=validate_every,
                           native_tail=native_tail, residual=residual, stream=stream, layer_weight=layer_weight)
    src, tgt = load_engine(source, device, dtype), load_engine(target, device, dtype)
    translator.check_pair(ModelSide.of(src), ModelSide.of(tgt))
    lengths = (config.max_prefix_chars, config.max_packed_chars, config.max_continuation_chars, config.packed_fraction, config.seed)
    # The same validation conversations for every run: past any fixed set's training samples (a
    # streamed run reads around them), and apart from the held-out split that eval lingo scores.
    held, held_read = training_texts("fit", config.validation_samples, *lengths, skip=VALIDATION_SKIP, recall_fraction=config.recall_fraction)
    if stream:  # drawn as the steps read them, around the validation conversations, each prepared when its step comes
        around = dict(recall_fraction=config.recall_fraction, avoid=range(VALIDATION_SKIP, held_read))
        available = sum(1 for _ in iter_training_texts("fit", *lengths, **around))  # texts only: seconds, where running dry would come hours in
        needed = min(steps, pause_at or steps) * accumulate  # a long schedule may run in pieces: this piece's end
        if available < needed:
            raise KvforgeError(f"--stream reads {needed} samples to step {needed // accumulate}, and the training conversations hold "
                               f"{available}: at most {available // accumulate} steps at --accumulate {accumulate} (--steps, or --pause-at)")
        drawn = iter_training_texts("fit", *lengths, **around)
        train = PreparedOnUse(translator, src, tgt, (sample for sample, _ in drawn), config.samples, config.top_k, config.native_tail,
                              layer_targets=bool(layer_weight))
    else:
        texts, read = training_texts("fit", config.samples, *lengths, recall_fraction=config.recall_fraction)
        if read > VALIDATION_SKIP:
            raise KvforgeError(f"--samples {samples} reads {read} conversations, into the validation ones (from {VALIDATION_SKIP}); use fewer, or --stream")
    with err.status("teacher: the target's native distributions, once"):
        if not stream:
            train = [prepare(translator, src, tgt, text, cut, config.top_k, config.native_tail, bool(layer_weight)) for text, cut in texts]
        validation = [prepare(translator, src, tgt, text, cut, config.top_k, config.native_tail) for text, cut in held]
    from kvforge.translate.distill import validation_kl

    common = {"command": "fit lingo", "model": target, "source": source, "target": target, "method": "lingo", "stage": 2, "dtype": dtype_of(tgt),
              **({} if stream else {"tokens": sum(len(s.target_ids) for s in train)}),
              "steps": steps, "accumulate": accumulate, "samples": samples, "stream": stream,
              "recall_fraction": recall_fraction, "native_tail": native_tail, "residual": residual, "layer_weight": layer_weight, "validation_samples": len(validation)}
    if lr_sweep:
        report = lambda rate, kl: err.print(f"[dim]lr {rate:.2e}: validation KL {kl:.4f} after {steps} steps[/dim]")  # noqa: E731
        common["validation_kl_start"] = validation_kl(translator, tgt, validation)  # the stage-1 maps
        results = sweep_learning_rates(translator, tgt, train, validation, config, half_decade_rates(lr), progress=report)
        best = min(results, key=lambda r: r[1])
        summary = {**common, "lr_sweep": [{"lr": r, "validation_kl": kl} for r, kl in results], "lr_selected": best[0]}
        if json_out:
            emit_json(summary)
        else:
            err.print(f"selected lr {best[0]:.2e} (validation KL {best[1]:.4f}) of {[f'{r:.1e}' for r, _ in results]}")
        return
    with tqdm(total=steps, unit="step", desc=f"distill {source} → {target}", file=sys.stderr, disable=json_out and not sys.stderr.isatty()) as bar:

        ran = []

        def progress(state, _seconds):
            ran.append(state.step)
            bar.n = state.step
            bar.set_postfix(loss=f"{state.losses[-1]:.4f}", val_kl=f"{state.validation[-1][1]:.4f}" if state.validation else "-")
            bar.refresh()

        heldout = None
        if heldout_every:
            from kvforge.evaluate.lingo import HeldOutBpb, LingoEvalSettings

            # past the conversations `eval lingo --samples 96` scores, so a step picked from the curve is not picked on them
            settings = LingoEvalSettings(samples=heldout_samples, skip=HELDOUT_CURVE_SKIP, native_tail=native_tail)
            heldout = HeldOutBpb(src, tgt, translator.align, settings)
            with err.status(f"held out: {heldout_samples} conversations on the target's and the source's own caches"):
                common.update(heldout_samples=len(heldout.texts), heldout_skip=HELDOUT_CURVE_SKIP, heldout_every=heldout_every,
                              heldout_reference=heldout.reference())
        started = time.perf_counter()
        translator, state = distill(translator, tgt, train, validation, config, checkpoint, progress, heldout=heldout, heldout_every=heldout_every,
                                    heldout_setting=heldout.setting if heldout else "", pause_at=pause_at)
        seconds = time.perf_counter() - started
        heldout_seconds = heldout.seconds if heldout else 0.0
    path = out or translator_stage2_path(source, target)
    if state.step < steps:  # a piece of a longer run: beside the final file, never in its place
        path = Path(str(path)).with_name(f"{Path(str(path)).stem}-step{state.step}.safetensors")
    path = translator.save(path)
    from kvforge.translate.distill import plot_distill

    if stream:
        common["samples_drawn"] = len(train.drawn)  # by this process: a resumed run draws from the start to where it stops
    summary = {**common, "lr": lr, "out": str(path), "steps": state.step, "planned_steps": steps, "losses": state.losses, "loss_first": state.losses[0],
               "loss_last": state.losses[-1], "validation_kl": state.validation, **({"heldout_bpb": state.heldout} if state.heldout else {}),
               "seconds": seconds, "heldout_seconds": heldout_seconds,
               "seconds_per_step": (seconds - heldout_seconds) / max(1, len(ran))}  # steps run by this process (a resumed run: fewer)
    summary["plot"] = plot_distill(summary, plot or Path("benchmarks/results") / f"lingo-distill-{figure_name(source)}-to-{figure_name(target)}.png")
    if json_out:
        emit_json(summary)
        return
    err.print(f"wrote {path}: {state.step} steps, loss {state.losses[0]:.4f} → {state.losses[-1]:.4f}, validation KL {state.validation}"
              + (f", held-out bits per byte {state.heldout}" if state.heldout else "")
              + (f" (own caches: {common['heldout_reference']})" if "heldout_reference" in common else ""))


@app.command()
@user_errors
def handoff(
    source: str = SourceOpt,
    target: str = TargetOpt,
    translator: Optional[Path] = TranslatorOpt,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Text the source has prefilled."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", "-f", help="Read the text from a file."),
    capture: Optional[str] = typer.Option(None, "--capture", help="Expected capture point (checked against the translator)."),
    turns: Optional[Path] = typer.Option(None, "--turns", help="A conversation instead: user messages, one per line (or a JSON list); SOURCE answers the first, the models alternate."),
    back_translator: Optional[Path] = typer.Option(None, "--back-translator", help="With --turns: TARGET → SOURCE translator (default: the cached one)."),
    mode: str = typer.Option("alternated", "--mode", help="With --turns: alternated (translate only new tokens), naive (retranslate the whole prefix) or native (re-prefill)."),
    native_tail: int = NativeTailOpt,
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """SOURCE prefills the text, its cache is translated, TARGET answers from it without re-prefilling."""
    from kvforge.generation import GenerationConfig
    from kvforge.translate.handoff import hand_off
    from kvforge.translate.translator import ModelSide

    setup_threads(threads)
    if turns is not None:
        if prompt is not None or prompt_file is not None:
            raise KvforgeError("give --turns or a prompt, not both")
        if native_tail:
            raise KvforgeError("--native-tail applies to one text; with --turns each new message is prefilled by its speaker already")
        return _handoff_turns(source, target, translator, back_translator, turns, mode, max_new_tokens, temperature, seed, device, dtype, json_out)
    if (prompt is None) == (prompt_file is None):
        raise KvforgeError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else read_prompt(prompt_file)
    tr = _translator(translator, source, target)
    src, tgt = load_engine(source, device, dtype), load_engine(target, device, dtype)
    tr.check_pair(ModelSide.of(src), ModelSide.of(tgt), capture)
    with err.status(f"{source} prefills"):
        h = hand_off(tr, src, tgt, text, native_tail=native_tail)
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    out = tgt.generate([h.pending], config, cache=h.cache)[0]
    result = {
        "command": "handoff", "model": target, "source": source, "target": target, "method": "handoff", "dtype": dtype_of(tgt),
        "tokens": len(h.target_ids), "source_tokens": len(h.source_ids), "native_tail": native_tail, "translate_s": h.translate_s,
        "ttft_s": h.translate_s + out.ttft_s, "decode_tokens_per_s": out.decode_tokens_per_s,
        "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
    }
    if json_out:
        emit_json(result)
        return
    sys.stdout.write(out.text + "\n")
    err.print(
        f"[dim]{source} → {target}: {len(h.source_ids)} → {len(h.target_ids)} tokens, translated in {h.translate_s:.3f} s, "
        f"TTFT {result['ttft_s']:.3f} s, {out.decode_tokens_per_s:.1f} tok/s[/dim]"
    )


def _read_turns(path: Path) -> list[str]:
    import json

    text = read_prompt(path)
    if text.lstrip().startswith("["):
        try:
            turns = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KvforgeError(f"{path} is not a valid JSON list of messages: {exc.msg} at line {exc.lineno}") from exc
        if not all(isinstance(t, str) for t in turns):
            raise KvforgeError(f"{path}: the JSON list must hold strings (user messages)")
    else:
        turns = text.splitlines()
    turns = [t for t in turns if t.strip()]
    if not turns:
        raise KvforgeError(f"{path} holds no user message")
    return turns


def _handoff_turns(source, target, translator, back_translator, turns_path, mode, max_new_tokens, temperature, seed, device, dtype, json_out):
    from kvforge.generation import GenerationConfig
    from kvforge.translate.session import MODES, Conversation

    if mode not in MODES:
        raise KvforgeError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    messages = _read_turns(turns_path)
    src, tgt = load_engine(source, device, dtype), load_engine(target, device, dtype)
    pair = None if mode == "native" else (_translator(translator, source, target), _translator(back_translator, target, source))
    conv = Conversation((src, tgt), pair, mode)
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    results = []
    for i, message in enumerate(messages):
        out = conv.respond(message, config)
        switch = conv.switches[-1] if i else None
        row = {"turn": i + 1, "speaker": conv.parties[i % 2].engine.model.name, "user": message, "text": conv.segments[-1],
               "ttft_s": out.ttft_s, "decode_tokens_per_s": out.decode_tokens_per_s,
               "caught_up_rows": switch.new_rows if switch else 0, "translated_rows": switch.translated_rows if switch else 0,
               "switch_s": switch.seconds if switch else 0.0}
        results.append(row)
        if not json_out:
            sys.stdout.write(f"[{row['speaker']}] {row['text'].strip()}\n")
            err.print(f"[dim]turn {row['turn']}: {row['translated_rows']} rows translated of {row['caught_up_rows']} caught up "
                      f"in {row['switch_s']:.3f} s, TTFT {row['ttft_s']:.3f} s[/dim]")
    if json_out:
        emit_json({"command": "handoff", "model": target, "source": source, "target": target, "method": "handoff", "mode": mode, "dtype": dtype_of(tgt),
               "tokens": len(conv.parties[(len(messages) - 1) % 2].ids), "turns": results})


@eval_app.command("lingo")
@user_errors
def eval_lingo_cmd(
    translator: Path = typer.Option(..., "--translator", help="Translator from `kvforge fit lingo`."),
    compare: list[Path] = typer.Option([], "--compare", help="Other translators of the pair (say stage 1), scored on the same samples."),
    samples: int = typer.Option(24, "--samples", help="Held-out continuations (0: skip)."),
    prefix_chars: int = typer.Option(2000, "--prefix-chars"),
    continuation_chars: int = typer.Option(400, "--continuation-chars"),
    qa: int = typer.Option(0, "--qa", help="Context-grounded questions (a fact stated early, asked at the end; 0: skip)."),
    qa_prefix_chars: int = typer.Option(1500, "--qa-prefix-chars", help="QA: characters of conversation holding the fact and the question."),
    native_tail: int = NativeTailOpt,
    multiturn: int = typer.Option(0, "--multiturn", help="Held-out conversations replayed with the models alternating (0: skip)."),
    turns: int = typer.Option(6, "--turns", help="Turns per multi-turn conversation."),
    turn_chars: int = typer.Option(300, "--turn-chars", help="Multi-turn: characters kept of each user message and each reply."),
    back_translator: Optional[Path] = typer.Option(None, "--back-translator", help="Multi-turn: the TARGET → SOURCE translator (default: the cached one)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="CKA PNG (default: benchmarks/results/lingo-cka-<source>-to-<target>.png)."),
    device: str = DeviceOpt,
    dtype: str = ReferenceDtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Target loss from the translated cache vs native caches (bits per byte), KL, R², CKA, effective
    rank; optionally context-grounded QA and per-turn loss over alternating turns."""
    from kvforge.evaluate.lingo import LingoEvalSettings, eval_lingo, plot_cka
    from kvforge.translate.translator import ModelSide, Translator

    if multiturn and native_tail and not (samples or qa):
        raise KvforgeError("--native-tail applies to one text (--samples, --qa); with --multiturn each new message is prefilled by its speaker already")
    setup_threads(threads)
    tr = Translator.load(translator)
    src, tgt = load_engine(tr.source.name, device, dtype), load_engine(tr.target.name, device, dtype)
    tr.check_pair(ModelSide.of(src), ModelSide.of(tgt))
    others = {}
    for path in compare:
        other = Translator.load(path)
        other.check_pair(ModelSide.of(src), ModelSide.of(tgt))
        others[_label(path, others)] = other
    name = f"{safe_name(tr.source.name)}-to-{safe_name(tr.target.name)}"
    report = {
        "command": "eval lingo", "model": tr.target.name, "source": tr.source.name, "target": tr.target.name, "method": "lingo",
        "dtype": dtype_of(tgt), "translator": str(translator), "capture": tr.capture, "align": tr.align, "assign": tr.assign, "nu": tr.nu,
        "head_wise": tr.head_wise, "stage": tr.info.get("stage", 1), "native_tail": native_tail, "compared": {label: str(p) for label, p in zip(others, compare)},
    }
    tick = lambda what: (lambda i, n: err.print(f"[dim]{what} {i}/{n}[/dim]"))  # noqa: E731
    if samples:
        settings = LingoEvalSettings(samples=samples, prefix_chars=prefix_chars, continuation_chars=continuation_chars, native_tail=native_tail)
        report.update(eval_lingo(tr, src, tgt, settings, progress=tick("sample"), compare=others))
        report["plot"] = plot_cka(report, tr, plot or Path("benchmarks/results") / f"lingo-cka-{name}.png")
    if qa:
        from kvforge.evaluate.qa import eval_qa, qa_items

        report["qa"] = eval_qa({"translated": tr, **others}, src, tgt, qa_items(qa, qa_prefix_chars), progress=tick("question"),
                               native_tail=native_tail)
        report.setdefault("tokens", report["qa"]["prompt_tokens"])
    if multiturn:
        from kvforge.evaluate.multiturn import MultiTurnSettings, eval_multiturn, plot_turns

        back = _translator(back_translator, tr.target.name, tr.source.name)
        settings = MultiTurnSettings(conversations=multiturn, turns=turns, user_chars=turn_chars, reply_chars=turn_chars)
        report["multiturn"] = eval_multiturn((src, tgt), (tr, back), settings, progress=tick("conversation"))
        report["multiturn"]["native_tail"] = 0  # each speaker prefills the new message itself; --native-tail is the other arms'
        report.setdefault("tokens", report["multiturn"]["tokens"])
        stage = f"-stage{report['stage']}"
        report["multiturn"]["plot"] = plot_turns(report["multiturn"], Path("benchmarks/results") / f"lingo-turns-{name}{stage}.png",
                                                 f"{tr.source.name} and {tr.target.name} alternating, stage-{report['stage']} translators")
    if json_out:
        emit_json(report)
        return
    _print_eval(report)


def _label(path: Path, taken: dict) -> str:
    label = path.stem
    return label if label not in taken else f"{label}-{len(taken)}"


def _print_eval(report: dict) -> None:
    if "bpb_ci" in report:
        table = Table("arm", "bits/byte", "95 % CI", "KL nats/token", "95 % CI")
        low_high = lambda ci: f"[{ci[0]:.4f}, {ci[1]:.4f}]"  # noqa: E731
        for arm in ("target_native", "target_translated", "target_zero", "source_native"):
            kl = {"target_translated": (f"{report['kl']:.4f}", low_high(report["kl_ci"])), "target_zero": (f"{report['kl_zero']:.4f}", "")}
            table.add_row(arm, f"{report[f'bpb_{arm}']:.4f}", low_high(report["bpb_ci"][arm]), *kl.get(arm, ("", "")))
        for label, row in report["compare"].items():
            table.add_row(f"translated: {label}", f"{row['bpb']:.4f}", low_high(row["bpb_ci"]), f"{row['kl']:.4f}", low_high(row["kl_ci"]))
        Console().print(table)
        for name, d in report["paired"].items():
            err.print(f"paired, {name.replace('_', ' ')}: {d['bpb']:+.4f} bits/byte {low_high(d['ci'])}")
        kinds = Table("alignment kind", "rows", "share of rows", "share of key error", "share of value error")
        for kind, row in report["error_by_alignment"].items():
            kinds.add_row(kind, str(row["rows"]), f"{row['row_share']:.3f}", f"{row['key_error_share']:.3f}", f"{row['value_error_share']:.3f}")
        Console().print(kinds)
        err.print(
            f"held-out R² keys {report['r2_keys_mean']:.3f}, values {report['r2_values_mean']:.3f}; {report['samples']} samples, "
            f"{report['tokens']} tokens; plot {report['plot']}"
        )
    if "qa" in report:
        qa = report["qa"]
        err.print(f"QA ({qa['questions']} questions, string match): " + ", ".join(f"{arm} {acc:.0f} %" for arm, acc in qa["accuracy"].items()))
    if "multiturn" in report:
        mt = report["multiturn"]
        table = Table("turn", "speaker", *[f"{m} bpb" for m in ("native", "alternated", "naive")])
        for t in range(mt["turns"]):
            table.add_row(str(t + 1), mt["speakers"][t], *[f"{mt[m]['bpb_per_turn'][t]:.4f}" for m in ("native", "alternated", "naive")])
        Console().print(table)
        err.print(f"[dim]{mt['conversations']} conversations; plot {mt['plot']}[/dim]")


@bench_app.command("lingo")
@user_errors
def bench_lingo_cmd(
    source: str = SourceOpt,
    target: str = TargetOpt,
    translator: Optional[Path] = TranslatorOpt,
    tokens: str = typer.Option("512,2048,4096", "--tokens", help="Comma-separated target prompt lengths."),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    native_tail: int = NativeTailOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Hand-off TTFT: the target's re-prefill vs translation + one decoding step."""
    from kvforge.artifacts import default_translator_path
    from kvforge.bench.lingo import bench_lingo
    from kvforge.translate.translator import ModelSide

    setup_threads(threads)
    lengths = parse_lengths(tokens)
    translator = translator or default_translator_path(source, target)  # resolved here: the report names it
    tr = _translator(translator, source, target)
    src, tgt = load_engine(source, device, dtype), load_engine(target, device, dtype)
    tr.check_pair(ModelSide.of(src), ModelSide.of(tgt))
    report = bench_lingo(tr, src, tgt, lengths, runs, progress=lambda m: err.print(f"[dim]{m}[/dim]"), native_tail=native_tail)
    report.update(translator=str(translator), stage=tr.info.get("stage", 1), assign=tr.assign, nu=tr.nu, own_tokens=tr.own_tokens, residual=tr.residual)  # which maps were timed
    if json_out:
        emit_json(report)
        return
    table = Table("tokens", "re-prefill s", "translate s", "step s", "hand-off s", "speedup", "MAC ceiling")
    for r in report["results"]:
        table.add_row(
            str(r["tokens"]), f"{r['reprefill_s']:.3f}", f"{r['translate_s']:.3f}", f"{r['step_s']:.3f}", f"{r['handoff_s']:.3f}",
            f"{r['speedup']:.1f}", f"{r['ceiling']:.1f}",
        )
    Console().print(table)
    r = report["results"][0]
    err.print(f"[dim]{report['threads']} thread(s), median of {runs}; translator {r['translator_macs_per_token']:,} MACs/token vs target {r['target_macs_per_token']:,.0f}[/dim]")
