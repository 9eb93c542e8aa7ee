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

A SPEED adapter (`kvforge fit speed`) records the policy it was trained under: cut, anchors and
tail. `resolve` applies all of it -- a flag may restate a recorded setting but not change it --
and runs the adapted weights as a second weight set (`lora.adapted_engine`), so the base engine
keeps the base model for every other method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvforge.errors import ArtifactError, KvforgeError
from kvforge.plan import PrefillPlan

if TYPE_CHECKING:
    from kvforge.engine import Engine
    from kvforge.fill.lora import LoraAdapter

DEFAULT_CUT = 0.75
# The last prompt rows at full depth: above the cut a reply then still sees the end of the user's
# turn. Measured on smollm2-135m at cut 22 (docs/speed.md): policy gap +36 % -> +19 % training-free,
# +12 % -> +9 % adapted, for 0.4 % of the 4K-token TTFT ceiling and 0.4 points of KV saving.
DEFAULT_TAIL = 64
BENCH_CUTS = (0.5, 0.75, 0.875)


@dataclass(frozen=True)
class SpeedConfig:
    cut: int  # layers [0, cut) hold shallow prompt rows
    first: int = 1  # the first `first` prompt rows are anchors (1 = the BoS / first token)
    rows: tuple[int, ...] = ()  # further anchor positions
    tail: int = DEFAULT_TAIL  # the last `tail` prompt rows run full depth (the last one always does)

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


def format_anchors(first: int, rows: tuple[int, ...] = ()) -> str:
    """The inverse of `parse_anchors`: (1, ()) -> 'bos'; (4, (17,)) -> 'first:4,17'; (0, ()) -> 'none'."""
    items = (["bos"] if first == 1 else [f"first:{first}"] if first > 1 else []) + [str(r) for r in rows]
    return ",".join(items) or "none"


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
    if config.cut == num_layers or bool(full.all()):
        why = f"SPEED cut {config.cut} is the model's depth" if config.cut == num_layers else (
            f"every row of the {prompt_tokens}-token prompt is an anchor or in the tail of {config.tail}"
        )
        return PrefillPlan.exact(total, num_layers, why)
    return PrefillPlan(torch.where(full, num_layers, config.cut), None, "speed")


def resolve_config(
    num_layers: int, cut: str | int | float | None = None, anchors: str | None = None, tail: int | None = None,
    lora: LoraAdapter | None = None,
) -> SpeedConfig:
    """The SPEED setting from flags (None: not given) and an adapter's recorded policy: a given
    flag that differs from what the adapter was trained with is a one-line `ArtifactError`;
    what is not given comes from the adapter, else the defaults (cut 0.75, anchors bos, tail 64)."""
    trained = dict(lora.info or {}) if lora is not None else {}
    name = f"adapter {lora.path or ''}".rstrip() if lora is not None else ""
    layers = resolve_cut(cut, num_layers) if cut is not None else None
    if "cut" in trained:
        if layers is not None and layers != int(trained["cut"]):
            raise ArtifactError(f"{name} was trained for SPEED cut {trained['cut']}, not cut {layers}: pass --cut {trained['cut']} or fit one for this cut")
        layers = int(trained["cut"])
    if layers is None:
        layers = resolve_cut(DEFAULT_CUT, num_layers)
    first, rows = parse_anchors(anchors) if anchors is not None else (None, None)
    if "anchors_first" in trained:
        recorded = (int(trained["anchors_first"]), tuple(int(r) for r in trained.get("anchor_rows", ())))
        if first is not None and (first, rows) != recorded:
            raise ArtifactError(
                f"{name} was trained with SPEED anchors {format_anchors(*recorded)}, not {format_anchors(first, rows)}: "
                f"pass --anchors {format_anchors(*recorded)} or leave it out"
            )
        first, rows = recorded
    if first is None:
        first, rows = parse_anchors("bos")
    if "tail" in trained:
        if tail is not None and tail != int(trained["tail"]):
            raise ArtifactError(f"{name} was trained with SPEED tail {trained['tail']}, not {tail}: pass --tail {trained['tail']} or leave it out")
        tail = int(trained["tail"])
    config = SpeedConfig(layers, first, rows, DEFAULT_TAIL if tail is None else tail)
    config.check(num_layers)
    return config


@dataclass(frozen=True)
class Speed:
    """A resolved SPEED setting: its config and the engine it runs on (the adapted weights when
    an adapter is given, else the engine passed in)."""

    config: SpeedConfig
    engine: Engine
    lora: LoraAdapter | None = None

    def plan(self, prompt_tokens: int) -> PrefillPlan:
        """The SPEED plan for a prompt of `prompt_tokens` rows on this engine."""
        return speed_plan(prompt_tokens, self.config, self.engine.num_layers)


def resolve(
    engine: Engine, cut: str | int | float | None = None, anchors: str | None = None, tail: int | None = None, adapter: str | Path | None = None
) -> Speed:
    """SPEED on `engine`: the adapter (if any) loaded, refused for another model, its whole
    policy applied (see `resolve_config`) and its weights set up beside the base ones."""
    lora, run_on = None, engine
    if adapter is not None:
        from kvforge.fill.lora import LoraAdapter, adapted_engine

        lora = LoraAdapter.load(adapter)
        lora.check_model(engine.model.name, engine.model.fingerprint, engine.num_layers)
        method = (lora.info or {}).get("method", "speed")
        if method != "speed":
            raise ArtifactError(f"adapter {adapter} was trained for {method}, not SPEED")
    config = resolve_config(engine.num_layers, cut, anchors, tail, lora)
    if lora is not None:
        run_on = adapted_engine(engine, lora)
    return Speed(config, run_on, lora)
