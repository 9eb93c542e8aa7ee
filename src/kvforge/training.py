"""The optimisation loop shared by SPEED fitting (LoRA factors) and KV-Lingo stage 2 (translator
maps): AdamW without weight decay, a cosine schedule after a linear warmup, gradient-norm
clipping and gradient accumulation.

One optimizer step calls the caller's loss `accumulate` times (one conversation each), scales
each loss by 1 / accumulate before its backward, so the step's gradient is the mean over its
conversations, clips the gradient norm, steps AdamW and then the schedule. The schedule's factor
at step s (0-based) is (s + 1) / warmup during the warmup and then follows half a cosine from 1 to
0 at step `steps`; warmup = max(1, round(warmup_fraction · steps)). `state_dict` holds only
tensors, numbers and lists, so a checkpoint of it loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch


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
