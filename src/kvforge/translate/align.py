"""Cross-tokenizer alignment: which source rows each target row reads.

Each model tokenizes the same text its own way, so the two caches have different rows. Every
token carries its character span in the text (the fast tokenizer's offsets). Rules:

- Head rows. The target's leading rows up to and including its first token with a span (BoS and
  any other span-less prefix, then the first text token) are computed by the target itself: a
  row at the start of the sequence sees only the rows before it, so a target forward over those
  few tokens gives their exact K/V. They are also the attention sink, whose state no linear map
  predicts (DESIGN: ~100× the median norm), so they are kept out of the fit as well.
- Every other target row i with span [s, e) reads source rows by one rule:
    cover  the source token holding the target token's last character e-1 (with byte-level
           tokenizers several tokens can share that character; the last of them, the one that
           completes it). It may read up to a few characters past e: the whole prefix is known
           at a hand-off, so that is not a leak, only a different cut of the same text.
    last   the last source token ending at or before e: never reads past the target token, but
           may stop short of it when a source token straddles e.
    mean   the mean of every source token overlapping [s, e) (a many-to-one average).
  Source tokens without a span (BoS, template tokens the text does not contain) are never
  read. A target row whose rule finds nothing (a span-less row after the head, or characters
  the source tokenizer dropped) reads what the row before it read; no input makes it fail.
- Same tokenizer: spans coincide, and every rule reads source row i for target row i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

ALIGN_RULES = ("cover", "last", "mean")


@dataclass(frozen=True)
class Tokenized:
    ids: list[int]
    spans: np.ndarray  # (T, 2) character [start, end), end == start for a span-less token


    def prefix(self, n: int) -> "Tokenized":
        return Tokenized(self.ids[:n], self.spans[:n])

    def tokens_before(self, c: int) -> int:
        """How many tokens come before the first token (with a span) starting at or after character c."""
        starts = np.flatnonzero((self.spans[:, 0] >= c) & (self.spans[:, 1] > self.spans[:, 0]))
        return int(starts[0]) if starts.size else len(self.ids)


def tokenize(tokenizer, text: str, add_special_tokens: bool = True) -> Tokenized:
    """Ids and character spans of `text` (needs a fast tokenizer)."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    spans = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    return Tokenized(list(enc["input_ids"]), spans)


@dataclass(frozen=True)
class Alignment:
    """Target rows [head, n) each read a weighted set of source rows."""

    head: int  # leading target rows the target computes itself
    index: torch.Tensor  # (n - head, F) source rows (int64), padded with repeats of a valid row
    weight: torch.Tensor  # (n - head, F) float32, rows sum to 1, padding weight 0
    rule: str

    @property
    def rows(self) -> int:
        return self.head + self.index.shape[0]

    def gather(self, features: torch.Tensor) -> torch.Tensor:
        """Source features (T_src, F_in) -> aligned features (n - head, F_in)."""
        # One weighted bag of source rows per target row (a one-row rule's bags hold one row).
        return F.embedding_bag(self.index.to(features.device), features, mode="sum",
                               per_sample_weights=self.weight.to(features.device, features.dtype))

    def truncate(self, rows: int) -> "Alignment":
        """The alignment of the first `rows` target rows (all of them native when rows <= head)."""
        if rows <= self.head:
            return Alignment(rows, self.index[:0], self.weight[:0], self.rule)
        return Alignment(self.head, self.index[: rows - self.head], self.weight[: rows - self.head], self.rule)


def head_rows(target: Tokenized) -> int:
    """Leading span-less target rows plus the first row with a span."""
    has_span = target.spans[:, 1] > target.spans[:, 0]
    if not has_span.any():
        return len(target.ids)
    return int(np.argmax(has_span)) + 1


def align(source: Tokenized, target: Tokenized, rule: str = "cover", head: int | None = None) -> Alignment:
    """The alignment of every target row to the source rows (see the module docstring). `head`
    overrides the native head rows (0 for a segment appended to a cache that has its sink)."""
    if rule not in ALIGN_RULES:
        raise ValueError(f"unknown alignment rule {rule!r}: use {', '.join(ALIGN_RULES)}")
    head = head_rows(target) if head is None else head
    src_rows = np.flatnonzero(source.spans[:, 1] > source.spans[:, 0])
    if src_rows.size == 0:
        raise ValueError("the source tokens carry no character spans: nothing to align")
    starts, ends = source.spans[src_rows, 0], source.spans[src_rows, 1]
    # Byte-level tokenizers may give a multi-token character overlapping spans; ends stay sorted.
    ends = np.maximum.accumulate(ends)
    spans = target.spans[head:]
    if rule == "mean":
        return _mean_alignment(head, spans, src_rows, starts, ends)
    # cover and last pick one source row per target row, found for all rows at once.
    s, e = spans[:, 0], spans[:, 1]
    if rule == "cover":
        j = np.searchsorted(ends, e, side="left")
        placed = (e > s) & (j < len(ends))
        j = np.searchsorted(ends, ends[np.minimum(j, len(ends) - 1)], side="right") - 1
    else:
        j = np.searchsorted(ends, e, side="right") - 1
        placed = (e > s) & (j >= 0)
    rows = np.where(placed, src_rows[np.clip(j, 0, len(src_rows) - 1)], -1)
    # A row no rule can place reads what the row before read (before any: the first source row).
    rows = rows[np.maximum.accumulate(np.where(placed, np.arange(len(rows)), 0))]
    rows = np.where(rows < 0, src_rows[0], rows)
    index = torch.from_numpy(rows.astype(np.int64)).view(-1, 1)
    return Alignment(head, index, torch.ones(index.shape, dtype=torch.float32), rule)


def _mean_alignment(head: int, spans: np.ndarray, src_rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Alignment:
    """The mean rule: every source row overlapping the target row's span, equally weighted."""
    picks: list[list[int]] = []
    previous = [int(src_rows[0])]
    for s, e in spans:
        chosen = [int(src_rows[j]) for j in np.flatnonzero((starts < e) & (ends > s))] if e > s else []
        chosen = chosen or previous
        picks.append(chosen)
        previous = chosen
    width = max((len(p) for p in picks), default=1)
    index = torch.zeros(len(picks), width, dtype=torch.long)
    weight = torch.zeros(len(picks), width, dtype=torch.float32)
    for i, p in enumerate(picks):
        index[i, : len(p)] = torch.tensor(p)
        index[i, len(p) :] = p[0]
        weight[i, : len(p)] = 1.0 / len(p)
    return Alignment(head, index, weight, "mean")


# How a target row's token meets the source's tokens (`row_kinds`)
ROW_KINDS = ("one-to-one", "part of a source token", "several source tokens", "partial overlap", "unplaced")


def row_kinds(source: Tokenized, target: Tokenized, alignment: Alignment) -> list[str]:
    """For each aligned target row (from `alignment.head` on), how its token's character span
    [s, e) meets the source's tokens, whatever the alignment rule reads:
      one-to-one              one source token overlaps it, with the same span;
      part of a source token  one source token overlaps it and covers it: several target tokens share it;
      several source tokens   two or more source tokens overlap it;
      partial overlap         one source token overlaps it without covering it (characters the
                              source's tokens do not hold);
      unplaced                no span, or no source token overlaps it: every rule makes the row
                              read what the row before it read."""
    spans = source.spans[source.spans[:, 1] > source.spans[:, 0]]
    starts, ends = spans[:, 0], spans[:, 1]
    kinds = []
    for s, e in target.spans[alignment.head : alignment.rows]:
        overlapping = np.flatnonzero((starts < e) & (ends > s)) if e > s else np.empty(0, dtype=np.int64)
        if overlapping.size == 0:
            kinds.append("unplaced")
        elif overlapping.size > 1:
            kinds.append("several source tokens")
        elif (starts[overlapping[0]], ends[overlapping[0]]) == (s, e):
            kinds.append("one-to-one")
        elif starts[overlapping[0]] <= s and ends[overlapping[0]] >= e:
            kinds.append("part of a source token")
        else:
            kinds.append("partial overlap")
    return kinds
