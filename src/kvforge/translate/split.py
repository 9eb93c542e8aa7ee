"""A text cut for a hand-off where both tokenizers start a token, with both models' caches of it.

Evaluation (`evaluate.lingo`) and stage-2 training (`translate.distill`) cut each text at a
character c where the source's and the target's tokenizations both start a token, so both models
read exactly text[:c] and score exactly text[c:].
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.cache import KVCache
from kvforge.translate.align import Alignment, Tokenized, align, tokenize


def common_boundary(a: Tokenized, b: Tokenized, limit: int) -> int:
    """The largest character position in (0, limit] where both tokenizations start a token."""
    starts = lambda t: {int(s) for s, e in t.spans if e > s}  # noqa: E731
    common = [c for c in starts(a) & starts(b) if 0 < c <= limit]
    if not common:
        raise ValueError("the two tokenizations share no token boundary in the prefix")
    return max(common)


@dataclass
class SplitText:
    """A text cut for a hand-off at character `cut`, where both tokenizers start a token: the
    source's exact cache of its prefix, the target's native cache of its prefix but the last
    token, and the alignment of the target's prefix rows but the last."""

    src: Tokenized
    tgt: Tokenized
    cut: int
    source_prefix: int  # source tokens before the cut
    target_prefix: int  # target tokens before the cut
    alignment: Alignment
    source_cache: KVCache
    native_cache: KVCache | None  # None when split without it


def split_text(source, target, text: str, limit: int, rule: str, native: bool = True) -> SplitText:
    """Cut `text` at the last character <= `limit` where both tokenizations start a token.
    `native=False` skips the target's own prefill (a hand-off needs only the source's cache)."""
    src, tgt = tokenize(source.model.tokenizer, text), tokenize(target.model.tokenizer, text)
    c = common_boundary(src, tgt, limit)
    ps, pt = src.tokens_before(c), tgt.tokens_before(c)
    alignment = align(src.prefix(ps), tgt.prefix(pt), rule).truncate(pt - 1)
    _, source_cache = source.prefill([src.ids[:ps]], logits="none")
    native_cache = target.prefill([tgt.ids[: pt - 1]], logits="none")[1] if native else None
    return SplitText(src, tgt, c, ps, pt, alignment, source_cache, native_cache)
