"""Driving computations written as generators: a long prefill yields at points where its caller
(the server's scheduler) may pause it to run other work, and returns its result at the end
(`Engine.prefill_steps`, `Engine.forward_steps`, `attention.attend_steps`)."""

from __future__ import annotations

import torch


def in_inference_mode(steps):
    """Drive generator `steps` with each of its steps under inference mode, and yield what it
    yields outside it: a generator that is not itself under inference mode (`run_plan_steps`, which
    training runs too) can serve a prefill whose caller does other work between its steps."""
    try:
        while True:
            with torch.inference_mode():
                try:
                    point = next(steps)
                except StopIteration as done:
                    return done.value
            yield point
    finally:
        steps.close()  # closed midway (a cancelled prefill): the inner steps end with it


def run_to_end(steps):
    """Drive a generator such as `Engine.prefill_steps` to its end; returns what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
