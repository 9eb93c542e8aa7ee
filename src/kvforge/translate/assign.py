"""Layer assignment: which source layers E_ℓ each target layer reads, keys and values apart.

  identity  E_ℓ = {ℓ} (equal depth only);
  depth     the band of ν consecutive source layers centred on the relative-depth counterpart
            c(ℓ) = 1 + (ℓ-1)(N_src-1)/(N_tgt-1) (1-based), shifted inside [1, N_src] at the ends;
  r2        the ν source layers whose single-layer ridge fit explains target layer ℓ best;
  greedy    forward selection: ν times, add the source layer that most reduces the residual of
            the joint fit with those already chosen.
The last two are read off the moments the closed-form fit accumulates anyway (every source
layer against every target layer), so they cost ridge solves and no pass over the data. Layers
are 0-based in code.
"""

from __future__ import annotations

import math

import torch

from kvforge import ridge

ASSIGNMENTS = ("identity", "depth", "r2", "greedy")


def relative_depth(layer: int, source_layers: int, target_layers: int) -> float:
    """c(ℓ) of 0-based target `layer`, 0-based."""
    if target_layers == 1:
        return 0.0
    return layer * (source_layers - 1) / (target_layers - 1)


def depth_band(layer: int, source_layers: int, target_layers: int, nu: int) -> list[int]:
    """ν consecutive source layers centred on c(ℓ), shifted to stay inside the source."""
    if not 1 <= nu <= source_layers:
        raise ValueError(f"nu must be in 1..{source_layers} (source layers), got {nu}")
    centre = relative_depth(layer, source_layers, target_layers)
    start = math.floor(centre - (nu - 1) / 2 + 0.5)
    start = min(max(start, 0), source_layers - nu)
    return list(range(start, start + nu))


def feature_block(layer: int, width: int) -> torch.Tensor:
    """Indices of one layer's features in the layers-side-by-side feature vector."""
    return torch.arange(layer * width, (layer + 1) * width)


def assign_layers(
    method: str,
    source_layers: int,
    target_layers: int,
    nu: int,
    moments: ridge.Moments | None = None,
    source_width: int = 0,
    target_width: int = 0,
    lam: float = 0.0,
    progress=None,
) -> list[list[int]]:
    """E_ℓ for every target layer (sorted source layer numbers). `moments` (all source layers'
    features side by side against all target layers') is needed by r2 and greedy."""
    if method not in ASSIGNMENTS:
        raise ValueError(f"unknown layer assignment {method!r}: use {', '.join(ASSIGNMENTS)}")
    if not 1 <= nu <= source_layers:
        raise ValueError(f"nu must be in 1..{source_layers} (source layers), got {nu}")
    if method == "identity":
        if source_layers != target_layers or nu != 1:
            raise ValueError(f"identity assignment needs equal depths and nu 1 (source {source_layers}, target {target_layers} layers)")
        return [[layer] for layer in range(target_layers)]
    if method == "depth":
        return [depth_band(layer, source_layers, target_layers, nu) for layer in range(target_layers)]
    if moments is None:
        raise ValueError(f"the {method} assignment needs the fit's moments")
    groups = [feature_block(s, source_width) for s in range(source_layers)]
    out = []
    for layer in range(target_layers):
        outputs = feature_block(layer, target_width)
        if method == "r2":
            scores = [ridge.explained(moments.select(g, outputs), lam) for g in groups]
            chosen = sorted(range(source_layers), key=lambda s: -scores[s])[:nu]
        else:
            chosen = ridge.greedy_select(moments, groups, nu, outputs, lam)
        out.append(sorted(chosen))
        if progress:
            progress(layer)
    return out
