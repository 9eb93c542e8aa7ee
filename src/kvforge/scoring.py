"""Teacher-forced scoring: a model's loss on tokens it is made to read, one forward pass.

Shapes: T scored tokens, V vocabulary.

Two ways in, one loss. `continuation_logits` scores ids[prefix:] over a cache that already holds
ids[:prefix - 1] (any cache: exact, filled, translated): the last prefix token and the
continuation but its last token run exactly over it, as decoding would, and their logits predict
ids[prefix:]. `planned_nll` runs a whole sequence from an empty cache under a `PrefillPlan` (the
plan decides which rows run which layers; SPEED trains and is evaluated this way) and scores
ids[prefix:] the same way. Both are differentiable outside inference mode (KV-Lingo stage 2 and
SPEED fitting train through them); evaluations call them under `torch.inference_mode()`. Every
evaluation and trainer in kvforge scores through this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.cache import KVCache
from kvforge.plan import PrefillPlan


def continuation_logits(engine, ids: list[int], prefix: int, cache: KVCache, restore: bool = False) -> torch.Tensor:
    """(T, V) float32 logits predicting ids[prefix:], given `cache` holding ids[:prefix - 1].
    The continuation's rows are appended to the cache; `restore` trims them off again, so a cache
    shared by several scorings (an evaluation's memoised exact cache) is left as it was."""
    lengths = cache.lengths()
    seq = torch.tensor([ids[prefix - 1 : -1]], device=engine.device)  # (1, T)
    positions = torch.arange(prefix - 1, len(ids) - 1, device=engine.device).view(1, -1)
    h = engine.run_layers(engine.adapter.embed(seq), positions, cache)
    if restore:
        for layer, length in zip(cache.layers, lengths):
            layer.trim(layer.length - length)
    return engine.adapter.head(h)[0].float()


def token_nll(logits: torch.Tensor, targets: list[int] | torch.Tensor) -> torch.Tensor:
    """(T,) nats of each target under logits (T, V), on the logits' device (differentiable)."""
    targets = torch.as_tensor(targets, device=logits.device)
    return F.cross_entropy(logits.float(), targets, reduction="none")


def continuation_nll(engine, ids: list[int], prefix: int, cache: KVCache, restore: bool = False) -> torch.Tensor:
    """(T,) nats of ids[prefix:] given `cache` holding ids[:prefix - 1] (see `continuation_logits`)."""
    return token_nll(continuation_logits(engine, ids, prefix, cache, restore), ids[prefix:])


def planned_logits(engine, ids: list[int], prefix: int, plan: PrefillPlan) -> torch.Tensor:
    """(T, V) logits predicting ids[prefix:], each given everything before it, with the whole of
    `ids` run from an empty cache under `plan` (which covers every row of `ids`)."""
    seq = torch.tensor([ids], device=engine.device)  # (1, N)
    positions = torch.arange(len(ids), device=engine.device).unsqueeze(0)
    h, _ = engine.run_plan(seq, positions, engine.new_cache(1, capacity=len(ids)), plan)
    return engine.adapter.head(h[:, prefix - 1 : -1])[0]


def planned_nll(engine, ids: list[int], prefix: int, plan: PrefillPlan) -> torch.Tensor:
    """(T,) nats of ids[prefix:] given everything before each, under `plan` (`planned_logits`)."""
    return token_nll(planned_logits(engine, ids, prefix, plan), ids[prefix:])
