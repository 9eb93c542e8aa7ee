"""A conversation that switches model at every turn, each model keeping its own cache.

The conversation is a list of text segments in order: a prompt segment ("User: ...\\n\\nAssistant:",
after a blank-line separator from the second turn on) then the reply to it, and so on. Each model
(a *party*) tokenizes every segment on its own, as a chat server tokenizes each message as it
arrives, and keeps its own stream of tokens (with their character spans in the conversation)
and its own cache. Turn t is spoken by party t mod 2. Before it speaks, the speaker catches up
on the segments it has not seen, by `mode`:

  alternated  the missing segments are translated from the other party's cache, where they are
              native (the other party prefilled or generated them itself since the last switch),
              and appended to the speaker's cache: only the new tokens are translated, and the
              speaker's earlier rows (native or translated once) stay as they are;
  naive       the speaker's cache is rebuilt from the other party's *whole* cache (head rows
              native): the context and earlier replies are translated back and forth, once per
              switch, and a switch costs the whole prefix;
  native      the speaker prefills the missing segments itself (equal to re-prefilling the
              conversation: the exact reference, and what a switch costs without KV-Lingo).

The speaker then prefills its prompt segment natively (the new message) and replies: `respond`
generates, `score` teacher-forces a given reply and returns its loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvforge.cache import KVCache
from kvforge.errors import PromptError
from kvforge.generation import eos_token_ids
from kvforge.scoring import continuation_nll
from kvforge.translate.align import Tokenized, align, tokenize
from kvforge.translate.handoff import aligned_features, append_translated
from kvforge.translate.translator import ModelSide, Translator

MODES = ("alternated", "naive", "native")


@dataclass
class Party:
    """One model's view of the conversation: its token stream and its cache of a prefix of it."""

    engine: object
    ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # stream length after each segment held
    cache: KVCache | None = None

    @property
    def rows(self) -> int:
        return self.cache.lengths()[0] if self.cache is not None else 0

    def stream(self, start: int, end: int) -> Tokenized:
        return Tokenized(self.ids[start:end], np.asarray(self.spans[start:end], dtype=np.int64).reshape(-1, 2))

    def add(self, ids: list[int], spans: list[tuple[int, int]]) -> None:
        self.ids += ids
        self.spans += spans
        self.ends.append(len(self.ids))

    def run(self, upto: int) -> None:
        """Prefill stream rows [rows, upto) natively."""
        if upto > self.rows:
            if self.cache is None:
                self.cache = self.engine.new_cache(1, capacity=upto + 1)
            self.engine.prefill([self.ids[self.rows : upto]], cache=self.cache, logits="none")


@dataclass(frozen=True)
class Switch:
    """What catching up cost the speaker of one turn."""

    turn: int
    speaker: str
    new_rows: int  # speaker rows added for segments it had not seen
    translated_rows: int  # of which translated (0 in native mode)
    source_rows: int  # rows read from the other party's cache
    seconds: float


class Conversation:
    """Two engines taking turns; `translators[i]` maps party i's cache into party 1-i's."""

    def __init__(self, engines, translators: tuple[Translator, Translator] | None, mode: str = "alternated"):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: use {', '.join(MODES)}")
        if mode != "native":
            if translators is None:
                raise ValueError(f"{mode} mode needs a translator each way")
            for i in (0, 1):
                translators[i].check_pair(ModelSide.of(engines[i]), ModelSide.of(engines[1 - i]))
        self.parties = [Party(engines[0]), Party(engines[1])]
        self.translators = translators
        self.mode = mode
        self.segments: list[str] = []
        self.starts: list[int] = []
        self.switches: list[Switch] = []

    @property
    def turn(self) -> int:
        return len(self.segments) // 2

    def _add_segment(self, text: str) -> int:
        self.starts.append(self.starts[-1] + len(self.segments[-1]) if self.segments else 0)
        self.segments.append(text)
        return len(self.segments) - 1

    def _tokenize(self, party: Party, index: int) -> tuple[list[int], list[tuple[int, int]]]:
        tok = tokenize(party.engine.model.tokenizer, self.segments[index], add_special_tokens=index == 0)
        shift = self.starts[index]
        return tok.ids, [(int(s) + shift, int(e) + shift) if e > s else (int(s), int(e)) for s, e in tok.spans]

    def prompt_segment(self, user: str) -> str:
        return ("\n\n" if self.segments else "") + f"User: {user.strip()}\n\nAssistant:"

    # --- catching up ---------------------------------------------------------------------------
    def _catch_up(self, speaker: int) -> None:
        """Bring the speaker's cache to every segment so far (see the module docstring)."""
        sp, other = self.parties[speaker], self.parties[1 - speaker]
        seen, held = len(sp.ends), len(self.segments)
        if seen == held:
            return
        start, rows_before = time.perf_counter(), len(sp.ids)
        for index in range(seen, held):
            sp.add(*self._tokenize(sp, index))
        self._check_context(sp)
        translated = source_rows = 0
        if self.mode == "native" or len(other.ends) < held:
            sp.run(len(sp.ids))
        else:
            other.run(len(other.ids))  # its last generated token, if pending
            translator = self.translators[1 - speaker]
            if self.mode == "alternated":
                sp.run(rows_before)
                src_from = other.ends[seen - 1] if seen else 0
                translated, source_rows = self._append(translator, other, sp, src_from, rows_before)
            else:
                sp.cache = None
                translated, source_rows = self._append(translator, other, sp, 0, 0)
        self.switches.append(Switch(self.turn, sp.engine.model.name, len(sp.ids) - rows_before, translated, source_rows,
                                    time.perf_counter() - start))

    def _append(self, translator: Translator, source: Party, target: Party, src_from: int, tgt_from: int) -> tuple[int, int]:
        """Translate source stream rows [src_from, end) into target rows [tgt_from, end); on an empty
        target cache its head rows are computed natively first. Returns (translated, source) rows."""
        src = source.stream(src_from, len(source.ids))
        # Mid-conversation every new row is translated, its first one too: no head rows.
        alignment = align(src, target.stream(tgt_from, len(target.ids)), translator.align, head=None if tgt_from == 0 else 0)
        head = alignment.head
        target.run(tgt_from + head)
        if alignment.index.shape[0] == 0:
            return 0, 0
        aligned = aligned_features(translator, source.engine, source.cache, alignment, start=src_from)
        with torch.inference_mode():
            append_translated(translator, target.engine, aligned, tgt_from + head, target.cache, target.ids)
        return alignment.index.shape[0], len(src.ids)

    def _check_context(self, party: Party) -> None:
        limit = party.engine.model.context_length
        if len(party.ids) >= limit:
            raise PromptError(f"the conversation has {len(party.ids)} tokens but {party.engine.model.name}'s context is {limit} tokens")

    # --- turns -------------------------------------------------------------------------------
    def _open_turn(self, user_segment: str) -> Party:
        speaker = self.turn % 2
        self._catch_up(speaker)
        sp = self.parties[speaker]
        sp.add(*self._tokenize(sp, self._add_segment(user_segment)))
        self._check_context(sp)
        return sp

    def score(self, prompt_segment: str, reply_segment: str) -> tuple[float, int, int]:
        """Teacher-force `reply_segment` after `prompt_segment`: the speaker's loss on the reply's
        tokens in nats, the reply's UTF-8 bytes and its tokens."""
        sp = self._open_turn(prompt_segment)
        prefix = len(sp.ids)
        sp.add(*self._tokenize(sp, self._add_segment(reply_segment)))
        self._check_context(sp)
        sp.run(prefix - 1)
        with torch.inference_mode():
            nats = float(continuation_nll(sp.engine, sp.ids, prefix, sp.cache).sum())
        return nats, len(reply_segment.encode("utf-8")), len(sp.ids) - prefix

    def respond(self, user: str, config):
        """The speaker of this turn answers `user` (a `Generation`)."""
        if not user or not user.strip():
            raise PromptError("empty prompt: give some text")
        sp = self._open_turn(self.prompt_segment(user))
        sp.run(len(sp.ids) - 1)
        out = sp.engine.generate([sp.ids[-1]], config, cache=sp.cache)[0]
        tokenizer = sp.engine.model.tokenizer
        eos = eos_token_ids(sp.engine.model)
        ids = [t for t in out.token_ids if t not in eos]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        index = self._add_segment(text)
        ends = [len(tokenizer.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]
        starts = [0] + ends[:-1]
        shift = self.starts[index]
        sp.add(ids, [(s + shift, max(s, e) + shift) for s, e in zip(starts, ends)])
        return out

