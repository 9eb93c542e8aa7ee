"""SPEED: shallow prefill, deep decode.

Shapes: T prompt tokens, L layers.

A cut c (1 <= c <= L). Non-anchor prompt rows run layers [0, c) and are then *absent*: no
compute, no cache rows, invisible to every later query above the cut. Anchor rows (the first
token -- the BoS where the tokenizer adds one -- the first k, or listed positions) and the last
`tail` prompt rows run full depth, and so does every decode-phase token. Above the cut a decode
token therefore attends to the anchors, the tail and the decode-phase tokens only; below it, to
everything. The last prompt row produces the first output token, so it is always full depth: it
is the first decode-phase token, and `tail` > 1 widens that full-depth tail.

A SPEED prefill is a `PrefillPlan` with absent rows (no filler), so the engine, the cache and
decoding are the ones exact prefill uses: decode needs no special case, because the upper
layers' caches simply do not hold the shallow rows. Teacher-forced scoring and adaptation run the
same plan over prompt + reply, with reply rows full depth (`speed_plan(..., total=...)`).

A fractional cut is rounded down: 0.75 of a 30-layer model keeps shallow rows in 22 layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvforge.errors import KvforgeError
from kvforge.plan import PrefillPlan

DEFAULT_CUT = 0.75
BENCH_CUTS = (0.5, 0.75, 0.875)


@dataclass(frozen=True)
class SpeedConfig:
    cut: int  # layers [0, cut) hold shallow prompt rows
    first: int = 1  # the first `first` prompt rows are anchors (1 = the BoS / first token)
    rows: tuple[int, ...] = ()  # further anchor positions
    tail: int = 1  # the last `tail` prompt rows run full depth (the last one always does)

    def __post_init__(self):
        if self.tail < 1 or self.first < 0:
            raise ValueError("tail must be >= 1 and the first-k anchor count >= 0")

    def check(self, num_layers: int) -> None:
        if not 1 <= self.cut <= num_layers:
            raise ValueError(f"cut {self.cut} is outside 1..{num_layers} for a {num_layers}-layer model")

    def fraction(self, num_layers: int) -> float:
        return self.cut / num_layers


def resolve_cut(value: str | float | int, num_layers: int) -> int:
    """'0.75' or 0.75 -> floor(0.75 L) layers; '22' or 22 -> 22 layers. Must land in 1..L."""
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError as exc:
        raise ValueError(f"--cut takes a layer count (e.g. 22) or a fraction of the depth (e.g. 0.75), got {text!r}") from exc
    if "." in text or isinstance(value, float):
        if not 0 < number <= 1:
            raise ValueError(f"a fractional cut must lie in (0, 1], got {text}")
        cut = math.floor(number * num_layers + 1e-9)
    else:
        cut = int(number)
    if not 1 <= cut <= num_layers:
        raise ValueError(f"cut {text} gives {cut} layers, outside 1..{num_layers} for a {num_layers}-layer model")
    return cut


def parse_anchors(text: str) -> tuple[int, tuple[int, ...]]:
    """'bos' -> (1, ()); 'first:4' -> (4, ()); 'bos,17,40' -> (1, (17, 40)); 'none' -> (0, ())."""
    first, rows = 0, []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "bos":
            first = max(first, 1)
        elif item == "none":
            continue
        elif item.startswith("first:"):
            try:
                first = max(first, int(item.split(":", 1)[1]))
            except ValueError as exc:
                raise ValueError(f"--anchors first:K takes an integer K, got {item!r}") from exc
        else:
            try:
                rows.append(int(item))
            except ValueError as exc:
                raise ValueError(f"--anchors takes bos, first:K or token positions, comma-separated; got {item!r}") from exc
    if first < 0 or any(r < 0 for r in rows):
        raise ValueError("anchor positions must be >= 0")
    return first, tuple(sorted(set(rows)))


def full_depth_rows(prompt_tokens: int, config: SpeedConfig) -> torch.Tensor:
    """(T,) bool: the prompt rows that run every layer (anchors and the tail)."""
    if config.first > prompt_tokens:
        raise KvforgeError(f"anchors first:{config.first} reach past the {prompt_tokens}-token prompt")
    for row in config.rows:
        if row >= prompt_tokens:
            raise KvforgeError(f"anchor row {row} is past the {prompt_tokens}-token prompt")
    full = torch.zeros(prompt_tokens, dtype=torch.bool)
    full[: config.first] = True
    full[list(config.rows)] = True
    full[max(0, prompt_tokens - config.tail) :] = True
    return full


def speed_plan(prompt_tokens: int, config: SpeedConfig, num_layers: int, total: int | None = None) -> PrefillPlan:
    """The plan for a prompt of `prompt_tokens` rows, optionally followed by decode-phase rows up
    to `total` (teacher forcing: those rows run full depth, as decode tokens do)."""
    config.check(num_layers)
    if prompt_tokens < 1:
        raise KvforgeError("empty prompt: give at least one token")
    total = prompt_tokens if total is None else total
    full = torch.ones(total, dtype=torch.bool)
    full[:prompt_tokens] = full_depth_rows(prompt_tokens, config)
    return PrefillPlan(torch.where(full, num_layers, config.cut), None, "speed")
