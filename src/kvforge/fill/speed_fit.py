"""SPEED adaptation: LoRA fine-tuning of a model under the SPEED visibility policy.

The source studies SPEED with the model trained under the policy. Here the training forward *is*
the SPEED plan run over prompt + reply (`Engine.run_plan` with gradients on): shallow prompt rows
exist only below the cut, anchors, the tail and the reply rows run full depth, so above the cut a
reply token sees exactly what a decode token sees at inference. The loss is the reply's
next-token cross entropy (teacher forced, `scoring.planned_nll`), or (`loss="kl"`) the KL divergence
from the frozen base model's full-depth next-token distribution on the same text: every reply token
then carries the full-depth model's whole distribution, and the adapter is pulled toward the
reference SPEED is judged against instead of toward the data. `loss="ce+kl"` is the two beside each
other, with the adapted model itself at full depth as the teacher (its distribution computed
without gradients from the same weights): the cross entropy keeps learning the data, and the KL
pulls the policy's predictions toward those of the very model it is judged against (the policy gap
is SPEED vs full depth on the same adapted weights), where `kl`'s frozen teacher falls behind as
the adapter learns. Measured (smollm2-135m, docs/results.md#speed): `ce+kl` is the default, policy gap +2.1 % against `ce`'s +6.9 %
(40 held-out replies; +3.4 % on 80), with adapted SPEED itself as good as `ce`'s (within 1 %): the gap
closes mostly because the adapted model at full depth moves less from the base (-2.8 % against -8.0 %).
A KL weight of 2 closes the gap entirely by making both depths 4 % worse than the base: weight 1. Only the adapter's deltas train
(the base weights are frozen), in the shared loop `training.Trainer`: AdamW, no weight decay,
cosine schedule with warmup, gradient clipping at 1.0, one conversation per micro-batch with
gradient accumulation for the effective batch. `train="full"` trains every projection of every
layer whole instead of LoRA factors; `"full-above-cut"` only those of the layers at and above the
cut, whose inputs the policy changes (the backward pass then stops at the cut). Measured: that is
the wrong place for capacity (policy gap +16.2 % against LoRA everywhere's +6.9 %): above the cut a
reply token sees no prompt row, so what it knows of the prompt must be gathered below the cut. Every
layer whole gave +7.9 %, no better than LoRA at 4x the time: LoRA stays the default. With a
`checkpoint` path the run writes the adapter's tensors, the trainer and its progress there every
`checkpoint_every` steps (the shared `training.save_checkpoint`) and a run started with the same
settings resumes from it exactly: samples are visited in a fixed order by step number.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from kvforge.data.replies import ReplySample, reply_samples
from kvforge.engine import Engine
from kvforge.fill.lora import LoraAdapter
from kvforge.fill.speed import SpeedConfig, speed_plan
from kvforge.plan import PrefillPlan
from kvforge.scoring import planned_logits, planned_nll, token_nll
from kvforge.training import CheckpointKind, OptimConfig, Trainer, load_checkpoint, save_checkpoint


@dataclass(frozen=True)
class SpeedFitConfig:
    steps: int = 600  # with rank 32: as good as 1,200 (policy gap +6.9 % with CE, +2.1 % with ce+kl; docs/results.md#speed)
    rank: int = 32  # LoRA's; full fine-tuning has none
    train: str = "lora"  # or "full" (whole deltas on every projection) or "full-above-cut"
    alpha: float = 16.0
    lr: float = 5e-4
    warmup_fraction: float = 0.05
    accumulate: int = 1  # conversations per optimizer step
    max_tokens: int = 512  # prompt + reply per sample: sized for a step's cost on a 2-core CPU
    max_reply: int = 128
    seed: int = 0
    loss: str = "ce+kl"  # policy gap +1.5 % on 80 replies at KL_WEIGHT (CE alone +6.9 % on 40, "kl" from the base model +13.3 % at tail 1)
    kl_weight: float | None = None  # ce+kl's: loss = CE + kl_weight * KL; None: KL_WEIGHT for ce+kl

    def __post_init__(self):
        if self.steps < 1 or self.accumulate < 1 or self.max_tokens < 32:
            raise ValueError("--steps and accumulation must be >= 1 and --max-tokens >= 32")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.kl_weight is not None and (self.kl_weight <= 0 or self.loss != "ce+kl"):
            raise ValueError(f"--kl-weight must be > 0 and applies to --loss ce+kl only (got {self.kl_weight} with --loss {self.loss})")
        if self.kl_weight is None and self.loss == "ce+kl":
            object.__setattr__(self, "kl_weight", KL_WEIGHT)  # frozen; recorded in the checkpoint and the adapter as used
        if self.train not in TRAIN:
            raise ValueError(f"--train must be one of {', '.join(TRAIN)}, got {self.train!r}")
        if self.train == "lora" and self.rank < 1:
            raise ValueError(f"--lora-rank must be >= 1, got {self.rank}")


LOSSES = ("ce", "kl", "ce+kl")
# On 80 held-out replies (smollm2-135m, cut 22, 600 steps): policy gap +3.4 / +1.5 / -0.4 % at 1 / 1.5 / 2,
# adapted SPEED vs the base model -0.5 / +1.3 / +4.0 %: 2 closes the gap by making both depths worse.
KL_WEIGHT = 1.5
TRAIN = ("lora", "full", "full-above-cut")
CHECKPOINT = CheckpointKind("kvforge.speed-fit-checkpoint", 1, "SPEED fit")


def reply_nll(engine: Engine, sample: ReplySample, plan: PrefillPlan) -> torch.Tensor:
    """(R,) nats of each reply token given everything before it, under `plan` (which covers
    prompt + reply). Differentiable when called with gradients enabled."""
    return planned_nll(engine, sample.ids, sample.prompt_tokens, plan)


def reply_log_probs(engine: Engine, sample: ReplySample, speed: SpeedConfig | None) -> torch.Tensor:
    """(R, V) fp32 log-probabilities of the next token at each reply position, under SPEED (or
    exact, speed None)."""
    logits = planned_logits(engine, sample.ids, sample.prompt_tokens, sample_plan(engine, sample, speed))
    return torch.log_softmax(logits.float(), -1)


def sample_plan(engine: Engine, sample: ReplySample, speed: SpeedConfig | None) -> PrefillPlan:
    """SPEED over the prompt with the reply as decode-phase rows, or exact (speed None)."""
    if speed is None:
        return PrefillPlan.exact(len(sample.ids), engine.num_layers)
    return speed_plan(sample.prompt_tokens, speed, engine.num_layers, total=len(sample.ids))


def fit_speed(
    engine: Engine,
    speed: SpeedConfig,
    config: SpeedFitConfig,
    model_name: str,
    progress: Callable[[int, float], None] | None = None,
    checkpoint: Path | None = None,
    checkpoint_every: int = 25,
) -> LoraAdapter:
    """Train a LoRA adapter for `speed` on the fit split of the packaged chat data; resumes from
    `checkpoint` when that file exists (`progress` is called for the steps still to run)."""
    speed.check(engine.num_layers)
    torch.manual_seed(config.seed)
    for p in engine.model.hf.parameters():
        p.requires_grad_(False)
    full = config.train != "lora"
    layers = list(range(speed.cut, engine.num_layers)) if config.train == "full-above-cut" else None
    lora = LoraAdapter.new(engine.adapter, 0 if full else config.rank, config.alpha, model_name, engine.model.fingerprint,
                           config.seed, layers=layers)
    params = lora.parameters()
    for p in params:
        p.requires_grad_(True)
    trainer = Trainer(params, OptimConfig(config.lr, config.steps, config.warmup_fraction, config.accumulate))
    samples = _fit_samples(engine, config)
    run = {"step": 0, "losses": [], "tokens": 0, "seconds": 0.0}
    settings = {**asdict(config), **asdict(speed), "rows": list(speed.rows), "model": engine.model.fingerprint,
                "dtype": str(engine.dtype), "device": str(engine.device)}  # a resume in another dtype would not be the same run
    if checkpoint is not None and checkpoint.is_file():
        run = load_checkpoint(checkpoint, CHECKPOINT, settings, params, trainer, _parse_run)

    def loss(j: int) -> torch.Tensor:
        sample = samples[(run["step"] * config.accumulate + j) % len(samples)]
        run["tokens"] += len(sample.ids)
        if config.loss == "kl":
            with torch.no_grad():  # the teacher: base weights, every row at full depth
                teacher = reply_log_probs(engine, sample, None)
        with lora.applied(engine.adapter):
            if config.loss == "ce":
                return reply_nll(engine, sample, sample_plan(engine, sample, speed)).mean()
            if config.loss == "ce+kl":
                with torch.no_grad():  # the teacher: these very weights, every row at full depth
                    teacher = reply_log_probs(engine, sample, None)
            student = reply_log_probs(engine, sample, speed)
            kl = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")
            if config.loss == "kl":
                return kl
            return config.kl_weight * kl + token_nll(student, sample.ids[sample.prompt_tokens :]).mean()  # log-probs are logits too

    while run["step"] < config.steps:
        start = time.perf_counter()
        total = trainer.step(loss)
        run["losses"].append(total)
        run["step"] += 1
        run["seconds"] += time.perf_counter() - start
        if checkpoint is not None and (run["step"] % checkpoint_every == 0 or run["step"] == config.steps):
            save_checkpoint(checkpoint, CHECKPOINT, settings, params, trainer, run)
        if progress:
            progress(run["step"] - 1, total)
    for p in params:
        p.requires_grad_(False)
    losses = run["losses"]
    window = max(1, min(20, len(losses) // 4))
    lora.info = {
        "method": "speed",
        "cut": speed.cut,
        "cut_fraction": speed.fraction(engine.num_layers),
        "anchors_first": speed.first,
        "anchor_rows": list(speed.rows),
        "tail": speed.tail,
        "training": {**asdict(config), "data": "sharegpt fit split, one reply per conversation", "tokens": run["tokens"]},
        "loss_first": sum(losses[:window]) / window,
        "loss_last": sum(losses[-window:]) / window,
        "seconds": run["seconds"],
    }
    return lora


def _parse_run(saved: dict) -> dict:
    return {"step": int(saved["step"]), "losses": [float(x) for x in saved["losses"]], "tokens": int(saved["tokens"]),
            "seconds": float(saved["seconds"])}


def _fit_samples(engine: Engine, config: SpeedFitConfig) -> list[ReplySample]:
    """Enough distinct fit-split samples for the run (at most 2000), read once."""
    wanted = min(2000, config.steps * config.accumulate)
    tok = engine.model.tokenizer
    samples = list(itertools.islice(reply_samples(tok, "fit", config.max_tokens, max_reply=config.max_reply), wanted))
    if not samples:
        raise ValueError(f"no fit conversation fits in {config.max_tokens} tokens: raise --max-tokens")
    return samples
