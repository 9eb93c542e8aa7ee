"""The optimisation loop shared by SPEED fitting (LoRA factors) and KV-Lingo stage 2 (translator
maps): AdamW without weight decay, a cosine schedule after a linear warmup, gradient-norm
clipping and gradient accumulation.

One optimizer step calls the caller's loss `accumulate` times (one conversation each), scales
each loss by 1 / accumulate before its backward, so the step's gradient is the mean over its
conversations, clips the gradient norm, steps AdamW and then the schedule. The schedule's factor
at step s (0-based) is (s + 1) / warmup during the warmup and then follows half a cosine from 1 to
0 at step `steps`; warmup = max(1, round(warmup_fraction · steps)).

A checkpoint (`save_checkpoint` / `load_checkpoint`: the trained tensors, the trainer's state, the
run's settings and its progress) is written atomically and holds tensors, numbers, lists and
strings only, so it is read with `torch.load(weights_only=True)`: a checkpoint from elsewhere
cannot run code, and one that tries is refused. SPEED fitting and KV-Lingo stage 2 both use it.
"""

from __future__ import annotations

import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import torch

from kvforge.errors import ArtifactError

Progress = TypeVar("Progress")


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    steps: int
    warmup_fraction: float = 0.05
    accumulate: int = 1  # losses (conversations) per optimizer step
    clip: float = 1.0  # max gradient norm
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.lr <= 0 or self.steps < 1 or self.accumulate < 1:
            raise ValueError(f"the learning rate must be > 0 and steps and accumulation >= 1 (lr {self.lr}, steps {self.steps}, accumulate {self.accumulate})")
        if not 0 <= self.warmup_fraction <= 1 or self.clip <= 0:
            raise ValueError("the warmup fraction must be in [0, 1] and the clipping norm > 0")

    @property
    def warmup(self) -> int:
        return max(1, round(self.warmup_fraction * self.steps))


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The learning-rate factor at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


class Trainer:
    """AdamW and its schedule over `params`; `step(loss)` is one optimizer step."""

    def __init__(self, params: Iterable[torch.Tensor], config: OptimConfig):
        self.params = list(params)
        self.config = config
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: warmup_cosine(s, config.warmup, config.steps)
        )

    def step(self, loss: Callable[[int], torch.Tensor]) -> float:
        """`loss(j)` for j < accumulate, each backpropagated at 1 / accumulate; then clip, AdamW
        and the schedule. Returns the step's mean loss."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(self.config.accumulate):
            scaled = loss(j) / self.config.accumulate
            if scaled.requires_grad:  # a loss that reaches no parameter (a hand-off whose native tail covers every translated row) adds no gradient
                scaled.backward()
            total += float(scaled.detach())
        torch.nn.utils.clip_grad_norm_(self.params, self.config.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return total

    def state_dict(self) -> dict:
        """Optimizer and schedule state: tensors, numbers and lists only (weights-only loadable)."""
        return {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned, so training resumes bit for bit."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])


@dataclass(frozen=True)
class CheckpointKind:
    """What a checkpoint file says it is: `format` and `version` are written into it and checked
    on load; `label` names it in errors ("a version-2 kvforge distillation checkpoint")."""

    format: str
    version: int
    label: str


def save_checkpoint(path: Path, kind: CheckpointKind, settings: dict, params: list[torch.Tensor], trainer: Trainer, progress: dict) -> None:
    """Write params, trainer state, settings and progress to `path` atomically (temp file, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({
        "format": kind.format, "version": kind.version, "config": settings,
        "params": [p.detach().clone() for p in params], "trainer": trainer.state_dict(), "state": progress,
    }, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, kind: CheckpointKind, settings: dict, params: list[torch.Tensor], trainer: Trainer,
                    parse: Callable[[dict], Progress]) -> Progress:
    """Restore `params` and `trainer` in place from `path` and return `parse(saved progress)`.
    Anything but a plain checkpoint of this kind, these settings and these shapes is refused with
    a one-line error and changes nothing."""
    refuse = f"checkpoint {path} is not a version-{kind.version} kvforge {kind.label} checkpoint"
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        if "GLOBAL" in str(exc):  # torch's weights-only unpickler met a class or function
            raise ArtifactError(f"{refuse}: it holds Python objects beyond tensors and numbers, which could run code; refused") from None
        raise ArtifactError(f"{refuse}: it is not readable as one; delete it to start over") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ArtifactError(f"{refuse}: it is not readable as one ({type(exc).__name__}); delete it to start over") from None
    if not isinstance(saved, dict) or saved.get("format") != kind.format or saved.get("version") != kind.version:
        raise ArtifactError(f"{refuse}; delete it to start over")
    if saved.get("config") != settings:
        raise ValueError(f"checkpoint {path} was written with other settings; delete it or pass the same ones")
    try:
        values = saved["params"]
        if len(values) != len(params) or any(v.shape != p.shape for v, p in zip(values, params)):
            raise ArtifactError(f"checkpoint {path} holds tensors of other shapes than this run's; delete it to start over")
        progress = parse(saved["state"])
        with torch.no_grad():
            for p, value in zip(params, values):
                p.copy_(value)
        trainer.load_state_dict(saved["trainer"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ArtifactError(f"{refuse}: {type(exc).__name__} {exc}; delete it to start over") from None
    return progress
