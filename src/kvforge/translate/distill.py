"""Stage 2: self-distillation of a translator through the frozen target.

Each sample (`translate.samples`) is a plain-text conversation cut at the start of an assistant
reply (at a character where both tokenizers start a token): the prefix is handed off, the reply
is the continuation.
Teacher: the target's next-token distribution over the continuation given its *native* cache of
the prefix, computed once per sample and kept as its top-k log-probabilities (renormalised over
those k). Student: the same forward given the *translated* cache; the loss is KL(teacher ‖
student) per continuation token, and gradients flow through the frozen target into the maps only
(the source is frozen too: its aligned features are computed once per sample). With layer-wise
targets (`layer_weight`) the loss adds, for every target layer, the translated keys' and values'
squared error against the target's own rows of the same prefix (relative to their mean square),
which the closed form minimised on its own data: the KL pulls the maps toward what the continuation
reads, this term keeps every layer near the rows the target would have made. The loop is
`training.Trainer`: AdamW without weight decay, cosine schedule with warmup, gradient clipping,
gradient accumulation. A checkpoint (maps, optimizer, schedule, step, losses, validation history,
settings, held-out scores) is written atomically every `checkpoint_every` steps and a run resumes from it exactly
(samples are visited in a fixed seeded order by step number). The checkpoint holds tensors, numbers, lists
and strings only and is read with `torch.load(weights_only=True)`: a checkpoint from elsewhere
cannot run code, and one that tries is refused.

A streamed run (`stream`) reads new conversations at every step, each once, prepared when its step
comes (`PreparedOnUse`), where a fixed set of samples is visited round and round (256 samples were
fitted within 300 steps while the held-out scores did not improve: docs/lingo.md).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvforge.scoring import continuation_logits
from kvforge.training import CheckpointKind, OptimConfig, Trainer, load_checkpoint, save_checkpoint
from kvforge.translate.handoff import aligned_features, append_translated, native_rows
from kvforge.translate.split import split_text
from kvforge.translate.translator import SIDES, Translator

CHECKPOINT = CheckpointKind("kvforge.distill-checkpoint", 2, "distillation")


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 100  # 100 steps from 128 samples: the measured winner (250 steps from 256 samples recalled no more)
    # From the 320-conversation r2 ν = 5 closed forms, 3e-5 beat 1e-4 both ways (docs/lingo.md): into Gemma on every
    # count (+13.7 % vs +18.0 % bits per byte, 9 vs 8 of 16 recalled), into SmolLM2 +18.1 % vs +20.0 % at equal recall.
    lr: float = 3e-5
    warmup_fraction: float = 0.05
    accumulate: int = 8  # conversations per optimizer step (the source's effective batch)
    samples: int = 128
    validation_samples: int = 8
    max_prefix_chars: int = 2000  # ~500 tokens: one student forward + backward in a few seconds here
    max_packed_chars: int = 3000  # packed samples: several conversations, one question lifted to the end
    packed_fraction: float = 0.5
    recall_fraction: float = 0.5  # planted-fact samples (translate.samples): QA 0 -> 4 / 2 -> 7 of 16 at 100 steps
    max_continuation_chars: int = 400
    top_k: int = 32
    native_tail: int = 0  # the prefix's last tokens the student prefills natively over the translated rows (as `--native-tail` serves)
    residual: int = 0  # width of a residual branch trained beside each map (`Translator.with_residual`; 0: linear maps only)
    stream: bool = False  # every step new conversations (`samples` = steps x accumulate), each prepared when its step comes
    # layer-wise targets: this weight times the translated rows' mean relative squared error against
    # the target's own rows of the same text (every layer, keys and values) is added to the KL
    layer_weight: float = 0.0
    validate_every: int = 25
    checkpoint_every: int = 25
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.accumulate < 1 or self.samples < 1 or self.top_k < 1:
            raise ValueError("steps, accumulate, samples and top_k must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"the learning rate must be > 0, got {self.lr}")
        if self.native_tail < 0:
            raise ValueError(f"--native-tail must be >= 0 tokens, got {self.native_tail}")
        if self.residual < 0:
            raise ValueError(f"--residual must be >= 0, got {self.residual}")
        if not 0 <= self.recall_fraction < 1:
            raise ValueError(f"--recall-fraction must be in [0, 1), got {self.recall_fraction}")
        if self.layer_weight < 0:
            raise ValueError(f"--layer-weight must be >= 0, got {self.layer_weight}")
        if self.stream and self.samples != self.steps * self.accumulate:
            raise ValueError(f"a streamed run reads steps x accumulate = {self.steps * self.accumulate} samples, not {self.samples}")


@dataclass
class DistillSample:
    target_ids: list[int]
    prefix: int  # target tokens of the prefix
    head: int  # target rows computed natively
    native_from: int  # rows [head, native_from) translated, [native_from, prefix - 1) the target's own (a native tail)
    aligned: dict[str, dict[int, torch.Tensor]]  # frozen source features of the translated rows
    teacher_logp: torch.Tensor  # (T, k) renormalised top-k log-probs
    teacher_index: torch.Tensor  # (T, k)
    # the target's own rows [head, native_from) per layer, keys and values (H, R, D) in bf16; None: not kept
    native_rows: dict[str, list[torch.Tensor]] | None = None


def prepare(translator: Translator, source, target, text: str, cut: int, top_k: int, native_tail: int = 0,
            layer_targets: bool = False) -> DistillSample:
    """Everything frozen about one sample: aligned source features of the rows the student
    translates (all but the head and the last `native_tail`), the teacher's top-k, and with
    `layer_targets` the target's own keys and values of those rows (bf16, every layer: for a
    500-token prefix 9 MB into gemma3-270m, 11.5 MB into smollm2-135m, so a fixed set of 256
    samples keeps 2-3 GB of them)."""
    with torch.inference_mode():
        # cut + 1: a prefix ending "Assistant:" keeps the space when the tokenizer splits it off
        split = split_text(source, target, text, cut + 1, translator.align)
        pt = split.target_prefix
        head, native_from = native_rows(split.alignment, native_tail)
        alignment = split.alignment.truncate(native_from)
        aligned = aligned_features(translator, source, split.source_cache, alignment) if alignment.index.shape[0] else {"k": {}, "v": {}}
        logits = continuation_logits(target, split.tgt.ids, pt, split.native_cache)
        values, index = torch.topk(torch.log_softmax(logits.float(), -1), min(top_k, logits.shape[-1]), dim=-1)
        teacher = torch.log_softmax(values, -1)
        native = None
        if layer_targets:
            held = split.native_cache
            native = {side: [(held[layer].keys() if side == "k" else held[layer].values())[0, :, head:native_from].to(torch.bfloat16)
                             for layer in range(target.num_layers)] for side in SIDES}
    # Clones made outside inference mode: the student's backward saves them.
    frozen = {side: {layer: f.clone() for layer, f in d.items()} for side, d in aligned.items()}
    native = {side: [t.clone() for t in rows] for side, rows in native.items()} if native is not None else None
    return DistillSample(split.tgt.ids, pt, head, native_from, frozen, teacher.clone(), index.clone(), native)


class PreparedOnUse(Sequence):
    """`length` samples drawn from `texts` (an iterator of (text, cut)) and prepared when a step
    reads them (`prepare`), none kept: a streamed run's every sample is read once, in order, so its
    memory holds one sample's features and teacher at a time, and it reads only as many
    conversations as the steps it runs (a run paused early reads no further)."""

    def __init__(self, translator: Translator, source, target, texts: Iterator[tuple[str, int]], length: int, top_k: int,
                 native_tail: int = 0, layer_targets: bool = False):
        self.translator, self.source, self.target, self.texts, self.length = translator, source, target, texts, length
        self.top_k, self.native_tail, self.layer_targets = top_k, native_tail, layer_targets
        self.drawn: list[tuple[str, int]] = []

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> DistillSample:
        if not 0 <= index < self.length:
            raise IndexError(index)
        while len(self.drawn) <= index:
            try:
                self.drawn.append(next(self.texts))
            except StopIteration:
                raise ValueError(f"the training conversations hold {len(self.drawn)} samples: a streamed run reads "
                                 f"steps x accumulate of them, sample {index + 1} is past the end") from None
        text, cut = self.drawn[index]
        return prepare(self.translator, self.source, self.target, text, cut, self.top_k, self.native_tail, self.layer_targets)


def student_logits(translator: Translator, target, sample: DistillSample) -> torch.Tensor:
    """(T, V) logits over the continuation from the cache a hand-off serves: head rows native,
    translated rows, then the native tail (if any) over them. Differentiable in the translator."""
    return _student(translator, target, sample)[0]


def _student(translator: Translator, target, sample: DistillSample):
    """`student_logits`, and the cache they were read from (its translated rows differentiable)."""
    cache = target.new_cache(1, capacity=len(sample.target_ids))
    with torch.no_grad():
        target.prefill([sample.target_ids[: sample.head]], cache=cache, logits="none")
    if sample.aligned["k"]:
        append_translated(translator, target, sample.aligned, sample.head, cache, sample.target_ids)
    # The native tail and the continuation in one forward: a second append would overwrite cache
    # storage the first one's attention saved for the backward.
    ids = sample.target_ids
    positions = torch.arange(sample.native_from, len(ids) - 1, device=target.device).view(1, -1)
    h = target.run_layers(target.adapter.embed(torch.tensor([ids[sample.native_from : -1]], device=target.device)), positions, cache)
    return target.adapter.head(h[:, sample.prefix - 1 - sample.native_from :])[0].float(), cache


def student_kl(translator: Translator, target, sample: DistillSample) -> torch.Tensor:
    """Mean KL(teacher ‖ student) per continuation token, differentiable in the translator."""
    return _kl(student_logits(translator, target, sample), sample)


def _kl(logits: torch.Tensor, sample: DistillSample) -> torch.Tensor:
    student = torch.log_softmax(logits.float(), -1).gather(-1, sample.teacher_index)
    return (sample.teacher_logp.exp() * (sample.teacher_logp - student)).sum(-1).mean()


def student_loss(translator: Translator, target, sample: DistillSample, layer_weight: float = 0.0) -> torch.Tensor:
    """What stage 2 minimises: `student_kl`, plus with `layer_weight` that weight times the mean,
    over the target's layers and over keys and values, of the translated rows' squared error
    against the target's own rows of the same text, relative to those rows' mean square (each layer
    counts alike, whatever its scale). Differentiable in the translator."""
    if not layer_weight:
        return student_kl(translator, target, sample)
    if sample.native_rows is None:
        raise ValueError("layer-wise targets need samples prepared with layer_targets=True")
    logits, cache = _student(translator, target, sample)
    errors = []
    for side in SIDES:
        for layer, want in enumerate(sample.native_rows[side]):
            rows = cache[layer].keys() if side == "k" else cache[layer].values()
            got, want = rows[0, :, sample.head : sample.native_from].float(), want.float()
            if got.shape != want.shape:
                raise ValueError(f"layer {layer} holds {tuple(got.shape)} translated rows, its targets {tuple(want.shape)}")
            if want.numel():
                errors.append((got - want).pow(2).mean() / want.pow(2).mean().clamp(min=1e-12))
    layer_error = torch.stack(errors).mean() if errors else logits.new_zeros(())
    return _kl(logits, sample) + layer_weight * layer_error


def trainable(translator: Translator) -> list[torch.nn.Parameter]:
    """Turn the maps into parameters (in place) and return them."""
    params = []
    for side in SIDES:
        for store in translator.stores():
            store[side] = [torch.nn.Parameter(t.detach().float().clone()) for t in store[side]]
            params.extend(store[side])
    return params


@dataclass
class DistillState:
    step: int = 0
    losses: list[float] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, mean KL)
    heldout: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out score), when one is given
    heldout_setting: str = ""  # what those scores were taken on


def _parse_state(saved: dict) -> DistillState:
    pairs = lambda key: [(int(a), float(b)) for a, b in saved.get(key, [])]  # noqa: E731 (checkpoints from before held-out scores have none)
    return DistillState(int(saved["step"]), [float(x) for x in saved["losses"]], pairs("validation"), pairs("heldout"),
                        str(saved.get("heldout_setting", "")))


def validation_kl(translator: Translator, target, samples: list[DistillSample]) -> float:
    with torch.no_grad():
        return float(sum(float(student_kl(translator, target, s)) for s in samples) / len(samples))


def distill(translator: Translator, target, train: Sequence[DistillSample], validation: list[DistillSample], config: DistillConfig,
            checkpoint: Path | None = None, progress=None, validate_start: bool = True,
            heldout: Callable[[Translator], float] | None = None, heldout_every: int = 0, heldout_setting: str = "",
            pause_at: int | None = None) -> tuple[Translator, DistillState]:
    """Train the translator's maps in place (with `config.residual`, on a copy given a residual
    branch first) and return it; resumes from `checkpoint` when the file exists.
    Validation KL is taken every `validate_every` steps, at the end and (`validate_start`) before
    the first step; `heldout` (say held-out bits per byte) every `heldout_every` steps, before the
    first and at the end. Neither is a training setting: a run resumes under other values of them,
    but its held-out scores go on only on the same `heldout_setting` (what they are taken on).
    `pause_at`: stop at that step with everything written as at the end (validation, held-out
    score, checkpoint), for a long run in pieces; the next call with the checkpoint goes on."""
    target.model.hf.requires_grad_(False)  # frozen: gradients flow through it into the maps only
    if config.residual and translator.residual != config.residual:
        if translator.residual:
            raise ValueError(f"the translator has a residual branch of width {translator.residual}, not {config.residual}")
        translator = translator.with_residual(config.residual, config.seed)
    params = trainable(translator)
    trainer = Trainer(params, OptimConfig(config.lr, config.steps, config.warmup_fraction, config.accumulate))
    state = DistillState()
    if checkpoint is not None and checkpoint.is_file():
        state = load_checkpoint(checkpoint, CHECKPOINT, checkpoint_settings(config), params, trainer, _parse_state)
    if pause_at is not None and pause_at < state.step:
        raise ValueError(f"pause at step {pause_at}: the checkpoint is at step {state.step} already")
    scoring = heldout is not None and heldout_every > 0
    if scoring:
        if state.heldout and state.heldout_setting != heldout_setting:
            raise ValueError(f"the checkpoint's held-out scores were taken on {state.heldout_setting or 'other settings'}, "
                             f"not {heldout_setting}: resume with the same held-out settings")
        state.heldout_setting = heldout_setting
    # a streamed run reads its samples in order, once each; a fixed set in a seeded order, round and round
    order = list(range(len(train))) if config.stream else torch.randperm(len(train), generator=torch.Generator().manual_seed(config.seed)).tolist()
    if validation and validate_start and state.step == 0 and not state.validation:
        state.validation.append((0, validation_kl(translator, target, validation)))  # where training starts (stage 1)
    if scoring and state.step == 0 and not state.heldout:
        state.heldout.append((0, heldout(translator)))
    last = config.steps if pause_at is None else min(config.steps, pause_at)
    while state.step < last:
        start = time.perf_counter()
        first = state.step * config.accumulate
        total = trainer.step(lambda j: student_loss(translator, target, train[order[(first + j) % len(train)]], config.layer_weight))
        state.step += 1
        state.losses.append(total)
        if validation and (state.step % config.validate_every == 0 or state.step == last):
            state.validation.append((state.step, validation_kl(translator, target, validation)))
        if scoring and (state.step % heldout_every == 0 or state.step == last):
            state.heldout.append((state.step, heldout(translator)))
        if checkpoint is not None and (state.step % config.checkpoint_every == 0 or state.step == last):
            save_checkpoint(checkpoint, CHECKPOINT, checkpoint_settings(config), params, trainer,
                            {"step": state.step, "losses": list(state.losses), "validation": [list(v) for v in state.validation],
                             "heldout": [list(v) for v in state.heldout], "heldout_setting": state.heldout_setting})
        if progress:
            progress(state, time.perf_counter() - start)
    for side in SIDES:
        for store in translator.stores():
            store[side] = [p.detach().clone() for p in store[side]]
    translator.info = {**translator.info, "stage": 2, "distill": {**asdict(config), "step": state.step, "losses_first_last": [state.losses[0], state.losses[-1]],
                                                               "validation_kl": state.validation,
                                                               **({"heldout": state.heldout} if state.heldout else {})}}
    return translator, state


def checkpoint_settings(config: DistillConfig) -> dict:
    """The settings a checkpoint is written with and resumed under: a native tail of 0 is left
    out, so checkpoints written before the field existed still resume."""
    settings = asdict(config)
    for added in ("native_tail", "residual", "stream", "layer_weight"):  # settings added later: at 0, checkpoints written before them still resume
        if not settings[added]:
            del settings[added]
    return settings


def sweep_learning_rates(translator: Translator, target, train: list[DistillSample], validation: list[DistillSample],
                         config: DistillConfig, rates: list[float], max_rates: int = 9, progress=None) -> list[tuple[float, float]]:
    """Final validation KL of a short run from `translator` at each rate; while the best rate
    sits on an edge of those tried, one more rate half a decade further out is tried (at most
    `max_rates` in all), so the rate picked is interior. Sorted by rate."""
    results: dict[float, float] = {}
    pending = sorted(rates)
    while pending:
        for lr in pending:
            run = DistillConfig(**{**asdict(config), "lr": lr, "validate_every": config.steps, "checkpoint_every": config.steps})
            _, state = distill(copy.deepcopy(translator), target, train, validation, run, validate_start=False)
            results[lr] = state.validation[-1][1]
            if progress:
                progress(lr, results[lr])
        tried = sorted(results)
        best = min(tried, key=results.get)
        pending = []
        if len(tried) < max_rates and best == tried[0]:
            pending = [tried[0] / math.sqrt(10)]
        elif len(tried) < max_rates and best == tried[-1]:
            pending = [tried[-1] * math.sqrt(10)]
    return sorted(results.items())


def half_decade_rates(center: float, count: int = 5) -> list[float]:
    """`count` rates spaced half a decade apart, centred on `center`."""
    return [center * 10 ** (0.5 * (i - (count - 1) / 2)) for i in range(count)]


def plot_distill(summary: dict, path) -> str:
    """Training loss per step and validation KL over steps (step 0: the stage-1 maps); with a
    held-out curve (`heldout_bpb`), a second panel of held-out bits per byte against the two
    caches it is read against (`heldout_reference`)."""
    from kvforge.bench.plotting import new_figure, save_figure

    curve = summary.get("heldout_bpb") or []
    fig, axes = new_figure(2 if curve else 1, (12 if curve else 7, 4))
    ax = axes[0] if curve else axes
    trained = "training KL" if not summary.get("layer_weight") else f"training loss (KL + {summary['layer_weight']:g} x layer error)"
    ax.plot(range(1, len(summary["losses"]) + 1), summary["losses"], alpha=0.5, label=f"{trained} (per step)")
    steps, kl = zip(*summary["validation_kl"]) if summary["validation_kl"] else ((), ())
    ax.plot(steps, kl, marker="o", label=f"validation KL ({summary['validation_samples']} conversations)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("KL(native ‖ translated), nats/token")
    ax.set_title(f"stage 2: {summary['source']} → {summary['target']}, lr {summary['lr']:.1e}", fontsize=9)
    ax.legend()
    if curve:
        right = axes[1]
        steps, bpb = zip(*curve)
        right.plot(steps, bpb, marker="o", label=f"{summary['target']} from the translated cache")
        for (arm, value), style in zip(summary.get("heldout_reference", {}).items(), ("--", ":")):
            model = summary["target"] if arm == "target_native" else summary["source"]
            right.axhline(value, linestyle=style, color="gray", label=f"{model} on its own cache")
        right.set_xlabel("optimizer step")
        right.set_ylabel("bits per byte")
        # A resumed run given no --heldout-every still carries the scores its checkpoint holds, without their settings.
        samples = summary.get("heldout_samples")
        right.set_title(f"held out: {samples} conversations" if samples else "held out", fontsize=9)
        right.legend()
    return str(save_figure(fig, Path(path)))
