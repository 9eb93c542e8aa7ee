"""Hand-off: a source model's cache becomes a target model's cache, and the target goes on.

The source has prefilled the text (it holds the conversation so far). The target's cache gets
its head rows computed natively (a forward over a few leading tokens, see `align`) and every
later row but the last translated from the aligned source rows; the target's last token then
runs as an ordinary step on that cache, producing the first token, and the target decodes on at
its native speed: the translated cache has the target's own shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvforge.cache import KVCache, RowKind
from kvforge.steps import run_to_end
from kvforge.errors import PromptError
from kvforge.translate.align import Alignment, Tokenized, align, tokenize
from kvforge.translate.capture import cache_features, own_tokens
from kvforge.translate.translator import ModelSide, Translator


def check_source_cache(translator: Translator, cache: KVCache, rows: int) -> None:
    """One-line error unless `cache` has the source model's layout and `rows` rows."""
    s = translator.source
    layout = (len(cache), cache[0].k.shape[1], cache[0].k.shape[3])
    if layout != (s.num_layers, s.kv_heads, s.head_dim):
        raise ValueError(
            f"source cache has {layout[0]} layers × {layout[1]} KV heads × {layout[2]}, "
            f"but {s.name} has {s.num_layers} × {s.kv_heads} × {s.head_dim}"
        )
    if cache.batch_size != 1:
        raise ValueError(f"a hand-off translates one sequence, the source cache holds {cache.batch_size}")
    if cache.lengths()[0] != rows:
        raise ValueError(f"source cache holds {cache.lengths()[0]} rows but the text is {rows} source tokens")


def native_rows(alignment: Alignment, native_tail: int) -> tuple[int, int]:
    """(head, native_from): target rows [0, head) and [native_from, alignment.rows) are the target's
    own, computed by its prefill; the rows between them are translated."""
    if native_tail < 0:
        raise ValueError(f"native tail must be >= 0 tokens, got {native_tail}")
    head = min(alignment.head, alignment.rows)
    return head, max(head, alignment.rows - native_tail)


def translate_cache(
    translator: Translator, source, target, source_cache: KVCache, alignment: Alignment, target_ids: list[int], native_tail: int = 0
) -> KVCache:
    """The target's cache for target rows [0, alignment.rows): head rows native, the rest
    translated from `source_cache` (the source engine's exact cache of the same text) but the last
    `native_tail`, which the target prefills itself over the translated rows (the source's
    "translate the context, prefill the prompt" setting: the newest text, which the next tokens
    lean on most, is the target's own, for a prefill of `native_tail` tokens)."""
    return run_to_end(translate_cache_steps(translator, source, target, source_cache, alignment, target_ids, native_tail))


def translate_cache_steps(
    translator: Translator, source, target, source_cache: KVCache, alignment: Alignment, target_ids: list[int], native_tail: int = 0,
    chunk_size: int | None = None,
):
    """`translate_cache` as a generator that yields between pieces of the work, where a server
    runs its running requests' steps: None after each target layer's translated rows and between
    chunks of `chunk_size` native-tail tokens, and the points within a tail chunk where a server
    may pause (`Engine.forward_steps`: `PAUSE_POINTS`). With `chunk_size` None the translation
    and the tail run as one piece, the tail still pausable between its layers. Returns the cache."""
    head, native_from = native_rows(alignment, native_tail)
    cache = target.new_cache(1, capacity=alignment.rows + 1)
    if head:
        target.prefill([target_ids[:head]], cache=cache, logits="none")
    if native_from > head:
        with torch.inference_mode():
            aligned = aligned_features(translator, source, source_cache, alignment.truncate(native_from))
            rows = TranslatedRows.of(translator, target, aligned, head, target_ids)
        for layer in range(translator.target.num_layers):
            if layer and chunk_size:
                yield
            with torch.inference_mode():
                rows.append(layer, cache)
    if native_from < alignment.rows:
        if chunk_size:
            yield
        yield from target.prefill_steps([target_ids[native_from : alignment.rows]], cache=cache, chunk_size=chunk_size, logits="none")
    return cache


def aligned_features(translator: Translator, source, source_cache: KVCache, alignment: Alignment,
                     start: int = 0) -> dict[str, dict[int, torch.Tensor]]:
    """Per side, the aligned features (rows, H_s·D_s) of every source layer the translator reads;
    `alignment` indexes source rows from `start` on (a segment appended mid-conversation)."""
    keys, values = cache_features(source.adapter, source_cache, translator.capture)
    used = {s for side in translator.sources.values() for layer in side for s in layer}
    return {"k": {s: alignment.gather(keys[s][start:]) for s in used}, "v": {s: alignment.gather(values[s][start:]) for s in used}}


def append_translated(translator: Translator, target, aligned: dict[str, dict[int, torch.Tensor]], start: int, cache: KVCache,
                      target_ids: list[int]) -> None:
    """Translate aligned source features into target rows at positions start, start+1, ... and
    append them to every layer of `cache`; `target_ids`: the target's tokens from row 0 on (a
    translator with own-token inputs reads them). Differentiable in the translator's weights when
    called with gradients on (stage 2 trains through it)."""
    rows = TranslatedRows.of(translator, target, aligned, start, target_ids)
    for layer in range(translator.target.num_layers):
        rows.append(layer, cache)


@dataclass
class TranslatedRows:
    """What every target layer's translated rows are made from, computed once: the maps and the
    aligned features (in the cache's dtype under inference mode: bf16 runs on the fast units;
    stage 2's training and its no-grad validation keep the float32 maps they train), the
    own-token inputs, the positions and their rotary tables. `append(layer, cache)` writes one
    layer's rows, so a hand-off can go a layer at a time."""

    translator: Translator
    target: object
    aligned: dict[str, dict[int, torch.Tensor]]
    own: object
    positions: torch.Tensor
    rope: object

    @classmethod
    def of(cls, translator: Translator, target, aligned: dict[str, dict[int, torch.Tensor]], start: int, target_ids: list[int]) -> "TranslatedRows":
        if torch.is_inference_mode_enabled():
            translator = translator.in_dtype(target.dtype)
            aligned = {side: {s: f.to(translator.dtype) for s, f in features.items()} for side, features in aligned.items()}
        n = next(iter(aligned["k"].values())).shape[0]
        own = own_tokens(target, target_ids, start, n, translator.own_tokens)
        positions = torch.arange(start, start + n, device=target.device).view(1, -1)
        rope = target.adapter.rope(torch.empty(1, n, 1, dtype=target.dtype, device=target.device), positions)
        return cls(translator, target, aligned, own, positions, rope)

    def append(self, layer: int, cache: KVCache) -> None:
        t, n = self.translator.target, self.positions.shape[1]
        k = self.translator.apply("k", layer, self.aligned["k"], self.own).view(1, n, t.kv_heads, t.dim("k")).transpose(1, 2)
        v = self.translator.apply("v", layer, self.aligned["v"], self.own).view(1, n, t.kv_heads, t.dim("v")).transpose(1, 2)
        k = self.target.adapter.finish_keys(layer, k.to(self.target.dtype), self.rope, self.translator.capture)
        cache[layer].append(k, v.to(self.target.dtype), self.positions, RowKind.TRANSLATED)


@dataclass
class Handoff:
    """A translated cache ready for the target: `pending` is the target's last token, to run next."""

    cache: KVCache
    pending: int
    target_ids: list[int]
    source_ids: list[int]
    translate_s: float  # alignment + translation + the target's head (and native tail) rows


def hand_off(
    translator: Translator, source, target, text: str, source_cache: KVCache | None = None, target_tokens: Tokenized | None = None,
    native_tail: int = 0,
) -> Handoff:
    """Translate the source's cache of `text` into a target cache (the source prefills it first
    when no cache is given). `target_tokens`: the target's tokenization of `text` when the caller
    has made it -- the ids it serves, e.g. a rendered chat template tokenized without special
    tokens because it holds them already; by default `text` is tokenized with them. `native_tail`:
    the text's last tokens the target prefills itself (`translate_cache`). Raises a
    one-line error for a translator of another pair."""
    return run_to_end(hand_off_steps(translator, source, target, text, source_cache, target_tokens, native_tail))


def hand_off_steps(
    translator: Translator, source, target, text: str, source_cache: KVCache | None = None, target_tokens: Tokenized | None = None,
    native_tail: int = 0, chunk_size: int | None = None,
):
    """`hand_off` as a generator that yields between pieces of its work, where a server runs its
    running requests' steps: the source's prefill in chunks of `chunk_size` tokens, the translation
    a target layer at a time, the native tail in chunks (`translate_cache_steps`), and the points
    within an exact chunk where a server may pause (`Engine.forward_steps`: `PAUSE_POINTS`); None:
    the source's prefill and the rest each one piece, pausable within its chunk only. The checks run before the first yield. Returns the `Handoff`, whose `translate_s`
    counts its own work only."""
    translator.check_pair(ModelSide.of(source), ModelSide.of(target))
    if not text or not text.strip():
        raise PromptError("empty prompt: give some text")
    src = tokenize(source.model.tokenizer, text)
    tgt = target_tokens if target_tokens is not None else tokenize(target.model.tokenizer, text)
    for engine, tok in ((source, src), (target, tgt)):
        if len(tok.ids) >= engine.model.context_length:
            raise PromptError(f"prompt has {len(tok.ids)} tokens but {engine.model.name}'s context is {engine.model.context_length} tokens")
    if source_cache is None:
        _, source_cache, _ = yield from source.prefill_steps([src.ids], chunk_size=chunk_size, logits="none")
        if chunk_size:
            yield
    check_source_cache(translator, source_cache, len(src.ids))
    start = time.perf_counter()
    alignment = align(src, tgt, translator.align).truncate(len(tgt.ids) - 1)
    clock = [time.perf_counter() - start]
    cache = yield from _timed(translate_cache_steps(translator, source, target, source_cache, alignment, tgt.ids, native_tail, chunk_size), clock)
    return Handoff(cache, tgt.ids[-1], tgt.ids, src.ids, clock[0])


def _timed(steps, clock: list[float]):
    """Drive `steps`, yielding what it yields where it yields, and add the time it ran (not the time spent
    away at its yields) to clock[0]; returns what it returns."""
    try:
        while True:
            start = time.perf_counter()
            try:
                point = next(steps)
            except StopIteration as done:
                clock[0] += time.perf_counter() - start
                return done.value
            clock[0] += time.perf_counter() - start
            yield point
    finally:
        steps.close()  # a hand-off abandoned mid-way (its request aborted) ends its inner steps too
