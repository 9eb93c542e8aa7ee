"""Timing harness: arms run in one process on the same input, interleaved, after a warm-up;
the median of the timed runs is reported with the thread count, so noise from the other core
hits every arm alike."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def interleaved_medians(arms: dict[str, Callable[[], object]], runs: int = 3, warmup: int = 1) -> dict[str, float]:
    """Median seconds per arm: its wall time, unless it returns a float, the seconds it measured
    itself (for arms that time only part of what they do)."""

    def seconds(fn):
        def run():
            wall, measured = timed(fn)
            return {"s": measured if isinstance(measured, float) else wall}

        return run

    medians = interleaved_metric_medians({name: seconds(fn) for name, fn in arms.items()}, runs, warmup)
    return {name: m["s"] for name, m in medians.items()}


def interleaved_metric_medians(
    arms: dict[str, Callable[[], dict[str, float]]], runs: int = 3, warmup: int = 1
) -> dict[str, dict[str, float]]:
    """Per arm, the median of each figure its call returns ({figure: seconds}), over `runs`
    timed calls after `warmup`, arms interleaved."""
    if runs < 1:
        raise ValueError("runs must be >= 1")
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    order = list(arms.items())
    for i in range(warmup + runs):
        # Alternate the order, so neither arm always runs right after the other.
        for name, fn in order if i % 2 == 0 else order[::-1]:
            figures = fn()
            if i >= warmup:
                samples[name].append(figures)
    return {name: {key: statistics.median(f[key] for f in runs_) for key in runs_[0]} for name, runs_ in samples.items()}


def environment() -> dict:
    """What a timing depends on, reported beside it."""
    return {"threads": torch.get_num_threads(), "torch": torch.__version__}
