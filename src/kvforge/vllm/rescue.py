"""RidgeFill's decode-time rescue inside vLLM (`fill.rescue`): filled prompt rows recomputed
before the step whose pending token calls for them, and drafts that end before such a token.

Shapes: n rescued rows, E hidden size, m rows a request holds up to its last rescued one.

vLLM hands a model class no request ids. A running request's first block in the block table is
its own until it finishes, and a later request on that block starts with its own prefill, so the
RidgeFill class keeps each request's rescue (`DecodeRescue`: the prompt's n-gram occurrences, the
filled rows still pending, their split-layer states) under its first block (`RescueBook`).

At every other step, each request's tokens are recorded by position (a verification's rejected
drafts are overwritten by the next step's tokens at those positions), and the step's first token
(its pending token) calls for the rows its n-gram asks for. Those rows run layers [split, L) from
their split-layer states before the step's own forward (`late_layers`): at each layer their keys
and values are written into the paged cache through the backend's cache update, at the slots the
block table gives their positions, and each row attends over the request's rows up to its own
position, read back from the cache (`paged.read_rows`), as kvforge's engine computes them. The
step then runs vLLM's stock model over the cache as it stands.

The n-gram proposer runs in the same worker process. It recognises requests by their tokens, not
their blocks, so it follows the schedule itself: the class publishes each filled prompt's filled
rows (`publish`), the proposer starts a tracker for a new request with that prompt (`tracker`),
feeds it every committed token (a committed draft never triggers: drafts end before a token that
would), and cuts each draft before its first token that would trigger a rescue
(`DecodeRescue.draft_before`). That token then comes as a pending token, so every position of a
verification sees the rows plain decoding would, and drafted RidgeFill commits plain RidgeFill's
tokens.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from kvforge.fill.rescue import DecodeRescue, RescueConfig
from kvforge.vllm.paged import attend, attention_context, block_size, layout_of, read_rows, slots_of, visible_mask, write_into

# the filled prompts' schedules, by prompt, for the proposer (least recently published first out;
# a few bytes per prompt token each)
_SCHEDULES: OrderedDict[bytes, tuple[torch.Tensor, int, RescueConfig]] = OrderedDict()
SCHEDULE_LIMIT = 1024


def publish(prompt: list[int], filled: torch.Tensor, split: int, config: RescueConfig) -> None:
    """Record that `prompt` was prefilled with `filled` rows (T,) bool and will be rescued."""
    key = _key(prompt)
    _SCHEDULES[key] = (filled.cpu(), split, config)
    _SCHEDULES.move_to_end(key)
    while len(_SCHEDULES) > SCHEDULE_LIMIT:
        _SCHEDULES.popitem(last=False)


def tracker(prompt: list[int]) -> DecodeRescue | None:
    """A fresh rescue schedule (no states: it only says which tokens trigger) for a request with
    `prompt`, or None when no filled prefill of that prompt was published."""
    found = _SCHEDULES.get(_key(prompt))
    if found is None:
        return None
    filled, split, config = found
    return DecodeRescue(prompt, None, filled, split, config)


def _key(prompt: list[int]) -> bytes:
    return np.asarray(prompt, dtype=np.int64).tobytes()


class RescueBook:
    """The running requests' rescues, by their first block, bounded (least recently used first out:
    vLLM does not say when a request ends). Each entry also holds where its request's last step
    started and how many tokens it ran: the request's next step starts past the first of them and
    at most one past the last, so a step outside that window is another request's (one whose rows
    a connector loaded onto a block a finished request held), and the entry is dropped. Another
    request whose first step happens to fall inside the window is not told apart (docs/vllm.md)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.by_block: OrderedDict[int, tuple[DecodeRescue, int, int]] = OrderedDict()

    def start(self, first_block: int, rescue: DecodeRescue | None) -> None:
        """A request prefilled on `first_block`: its rescue, or None (a prompt that filled nothing)."""
        self.by_block.pop(first_block, None)
        if rescue is None:
            return
        self.by_block[first_block] = (rescue, 0, len(rescue.tokens))
        while len(self.by_block) > self.limit:
            self.by_block.popitem(last=False)

    def due(self, first_block: int, start: int, tokens: list[int]) -> tuple[DecodeRescue, list[int]] | None:
        """A step of `tokens` from position `start` for the request on `first_block`: its rescue and
        the rows its pending token (the first) calls for, or None (no rescue, or none due)."""
        entry = self.by_block.get(first_block)
        if entry is None:
            return None
        rescue, last_start, last_tokens = entry
        if not last_start < start <= last_start + last_tokens:
            del self.by_block[first_block]
            return None
        self.by_block[first_block] = (rescue, start, len(tokens))
        self.by_block.move_to_end(first_block)
        del rescue.tokens[start:]  # a verification's rejected drafts
        rescue.tokens.extend(tokens)
        rows = rescue.due(rescue.tokens[max(0, start + 1 - rescue.config.ngram) : start + 1])
        return (rescue, rows) if rows else None


def late_layers(model, rescue: DecodeRescue, rows: list[int], block_row: torch.Tensor) -> None:
    """Layers [split, L) of vLLM's Llama `model` for one request's `rows`, from their split-layer
    states: at each layer their keys and values replace the filled ones in the paged cache, and each
    row attends over the request's rows up to its own position. `block_row`: the request's row of
    the step's block table."""
    layers = model.model.layers
    positions = torch.tensor(rows, dtype=torch.long, device=block_row.device)
    seen = torch.arange(rows[-1] + 1, device=block_row.device)  # rows are sorted
    slots = slots_of(block_row, seen, block_size(layers[-1].self_attn.attn.layer_name))
    x = rescue.states[0, rows].to(block_row.device)  # the stream entering layer `split`
    residual = None
    for layer in layers[rescue.split :]:
        attn = layer.self_attn
        if residual is None:  # vLLM's layers carry (hidden, residual): the first takes the stream as both
            residual, xn = x, layer.input_layernorm(x)
        else:
            xn, residual = layer.input_layernorm(x, residual)
        qkv, _ = attn.qkv_proj(xn)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        _, vllm_attention, kv_cache, _ = attention_context(attn.attn.layer_name)
        write_into(vllm_attention, kv_cache, k, v, slots[positions])
        if layer is layers[-1]:  # what the last layer computes past its keys and values feeds nothing kept
            break
        keys, values = read_rows(kv_cache, slots, layout_of(vllm_attention))
        o, _ = attn.o_proj(attend(attn, q, keys, values, visible_mask(attn, positions, seen)))
        hidden, residual = layer.post_attention_layernorm(o, residual)
        x = layer.mlp(hidden)
