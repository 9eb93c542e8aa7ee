"""Timing harness: arms run in one process on the same input, interleaved, after a warm-up;
the median of the timed runs is reported with the thread count.

Interleaving rotates the order by one arm per round, so the slots rotate among the arms and
(with three or more arms) no arm runs twice in a row: a burst of load from the other core
then lands on different arms' runs instead of on two of one arm's. (Reversing the order each
round instead puts the first and last arms back to back at every turn, where one burst can
move two of three runs.) On a GPU the clock is read after the device finishes."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from kvforge.models.loading import dtype_name


def synchronize() -> None:
    """Wait for queued GPU work, so a clock read after it counts that work (no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call, the device's queued work included."""
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
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
    samples = interleaved_samples(arms, runs, warmup)
    return {name: {key: statistics.median(f[key] for f in runs_) for key in runs_[0]} for name, runs_ in samples.items()}


def interleaved_samples(
    arms: dict[str, Callable[[], dict[str, float]]], runs: int = 3, warmup: int = 1
) -> dict[str, list[dict[str, float]]]:
    """Per arm, the figures of each of its `runs` timed calls, in round order (round r of every
    arm ran in the same stretch of time, so per-round ratios between arms share its noise)."""
    if runs < 1:
        raise ValueError("runs must be >= 1")
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    order = list(arms.items())
    for i in range(warmup + runs):
        shift = i % len(order)
        for name, fn in order[shift:] + order[:shift]:
            figures = fn()
            if i >= warmup:
                samples[name].append(figures)
    return samples


def environment(engine=None) -> dict:
    """What a timing depends on, reported beside it (with an engine: the dtype it runs in)."""
    from kvforge.ops import kernels

    # machines differ between runs (AMX or not, AVX-512 or not): the kernels a run used go with it
    env = {"threads": torch.get_num_threads(), "torch": torch.__version__, "kernels": kernels.kind()}
    if engine is not None:
        env["dtype"] = dtype_name(engine.dtype)
    return env
