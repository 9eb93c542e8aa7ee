"""Capture points: what a translator reads from, and writes into, a KV cache.

Shapes: T rows, H KV heads, D head dim; features are (T, H·D), heads side by side.

A cache stores keys after the k-norm and RoPE. Keys are read at one of three points:
  post-rope  the stored keys;
  post-norm  the stored keys rotated back to position 0 (RoPE is a rotation, so this is exact);
  pre-norm   post-norm keys divided by the k-norm's per-dimension weight: the raw projected key
             up to each row's RMS, which the norm removed and the cache does not keep. The
             target's k-norm is invariant to that scale, so nothing the target reads is lost;
             for a family without k-norm (Llama) pre-norm and post-norm are the same keys.
Both models are read the same way, from exact caches, at fit time and at hand-off time, so a
translator sees at hand-off exactly the features it was fitted on. Written keys go back through
the target's own k-norm (pre-norm) and RoPE (pre- and post-norm) at the target's positions.
Values have no stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.cache import KVCache

CAPTURE_POINTS = ("pre-norm", "post-norm", "post-rope")


def check_point(point: str) -> str:
    if point not in CAPTURE_POINTS:
        raise ValueError(f"unknown capture point {point!r}: use {', '.join(CAPTURE_POINTS)}")
    return point


def cache_features(adapter, cache: KVCache, point: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys at `point` and values of sequence 0, per layer, as float32 (T, H·D) features."""
    check_point(point)
    lengths = set(cache.lengths())
    if len(lengths) != 1:
        raise ValueError("a translated cache must hold every row in every layer (an exact prefill)")
    positions = cache[0].row_positions()[:1]
    low_precision = cache[0].k.dtype != torch.float32
    # Keys are read back in fp32 (rotary tables too), whatever the cache holds.
    rope = adapter.rope(cache[0].keys()[:1, 0].float(), positions) if point != "post-rope" else None
    keys, values = [], []
    for layer in range(len(cache)):
        k = cache[layer].keys()[:1].float()
        if rope is not None:
            k = adapter.unrotate_keys(layer, k, rope)
            scale = adapter.key_norm_scale(layer) if point == "pre-norm" else None
            if scale is not None:
                scale = scale.float()
                dead = scale.abs() < 1e-6  # a k-norm weight of 0: the cache keeps nothing of that dimension
                k = k / torch.where(dead, torch.full_like(scale, 1e-6), scale)
                if low_precision:
                    # Unrotating mixes each dimension with its RoPE partner, so a dead dimension reads
                    # back its partner's rounding error; divided by 1e-6 that is ~1e-1 x the partner in
                    # fp32 (what translators were fitted on) but ~2e3 x in bf16, which swamps the
                    # features (gemma3-270m source: held-out bits per byte 3.39 instead of 0.95). Such
                    # a dimension carries no information, so it reads as 0 from a low-precision cache.
                    k = k.masked_fill(dead, 0.0)
        keys.append(_flat(k))
        values.append(_flat(cache[layer].values()[:1]))
    return keys, values


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(1, H, T, D) -> (T, H·D) float32."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1).float()


@dataclass
class OwnTokens:
    """The target's own tokens of N translated rows as map inputs: the RMS-normed embeddings of
    the distinct tokens among them, (U + 1, E) with row 0 zeros (the token before row 0), and for
    each row t and look-back j the row of token t-j in that table, (N, count).

    A translated row's source features carry the source's tokens, seen through another tokenizer
    and a linear map; the target knows its own token at every row for free (an embedding lookup),
    and its lower layers' rows are nearly functions of it (layer 0's are exactly linear in it).
    A map's own-token term depends on the token alone, so it is computed once per distinct token
    (`Translator.apply`): a long prompt repeats most of its tokens."""

    embeddings: torch.Tensor
    index: torch.Tensor

    @property
    def count(self) -> int:
        return self.index.shape[1]

    def features(self) -> torch.Tensor:
        """(N, count·E): each row's own-token embeddings side by side (t, t-1, ...), as a fit reads them."""
        return self.embeddings[self.index].reshape(self.index.shape[0], -1)


def own_tokens(target, ids: list[int], start: int, rows: int, count: int) -> OwnTokens | None:
    """`OwnTokens` of target rows start .. start+rows-1 (tokens `ids` from row 0 on); None when count is 0."""
    if count == 0:
        return None
    first = max(start - count + 1, 0)
    window = torch.tensor(ids[first : start + rows], dtype=torch.long)
    distinct, inverse = torch.unique(window, return_inverse=True)
    with torch.no_grad():
        e = target.adapter.embed(distinct.view(1, -1).to(target.device))[0].float()
    e = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-6)
    table = torch.cat([e.new_zeros(1, e.shape[1]), e])
    rows_of = torch.arange(start, start + rows).view(-1, 1) - torch.arange(count).view(1, -1)  # (N, count): t - j
    index = torch.where(rows_of >= first, inverse.to(table.device)[(rows_of - first).clamp(min=0)] + 1, 0)
    return OwnTokens(table, index.to(table.device))
