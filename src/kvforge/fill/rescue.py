"""RidgeFill's decode-time rescue: filled prompt rows recomputed when decoding starts to copy them.

A filled row's late-layer keys come from a predicted input, and what that loses most is copying
from the prompt: a copy matches the token before and reads the row after (docs/ridgefill.md:
exact keys under filled values remove most of the gap). So when the text being decoded ends in an
n-gram that also occurs in the prompt, the filled rows after its most recent occurrences are what
a copy reads next, and they are recomputed: their exact split-layer states (what the planned
prefill returned beside the cache) run layers [split, L), each row attending to the cache as it
stands up to itself, as the prefill's tail-attended rows do (`engine.RewrittenRows`), and their
keys and values replace the filled ones in place. Their row kind stays FILLED: kinds record what
the prefill ran (`PrefillReport`), and `DecodeRescue` counts what decoding rescued. TTFT does not
change; the cost is a late-layer pass over the rescued rows, paid while decoding and only when the
text copies.

The schedule, the same for every decode path (plain, drafted, batched, served, scored): the
token a step feeds first (its pending token) triggers the rescue its n-gram calls for, and the
rows are recomputed just before that step's forward (in a pass of their own, one sequence at a
time: the step's rows keep the shapes, and bits, of a step without a rescue), so every position
of the step sees them. A drafted token never triggers one: a draft ends before a token that would
(`would_rescue`), which then triggers it as the next step's pending token. So each position sees
the rows as plain decoding does, one token a step, and drafted RidgeFill commits plain
RidgeFill's tokens.

The rescue needs every late layer to hold every prompt row at its own position: a sliding-window
layer that skipped filled rows no exact row could see, or a recurrent layer (its state cannot
take a row back), turns it off (`DecodeRescue.of` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.cache import KVCache
from kvforge.engine import RewrittenRows
from kvforge.plan import PrefillPlan, final_depth


@dataclass(frozen=True)
class RescueConfig:
    ngram: int = 2  # tokens of the decoded text's end that must occur in the prompt
    window: int = 16  # filled rows rescued after each occurrence
    recent: int = 4  # the most recent occurrences looked at (a common pair occurs all over)

    def __post_init__(self):
        if min(self.ngram, self.window, self.recent) < 1:
            raise ValueError(f"rescue n-gram, window and occurrences must be >= 1, got {self.ngram}, {self.window}, {self.recent}")


class DecodeRescue:
    """One sequence's rescue: the prompt's n-gram occurrences, the rows still filled and their
    split-layer states. `due` names the rows a step's pending token calls for; `late_layers`
    recomputes them."""

    def __init__(self, prompt: list[int], states: torch.Tensor | None, filled: torch.Tensor, split: int, config: RescueConfig):
        """`states` (1, P, E): the prompt rows' split-layer states; None for a schedule that only
        says which tokens trigger (vLLM's proposer follows one)."""
        self.tokens, self.states, self.split, self.config = list(prompt), states, split, config
        self.pending = filled.clone().cpu()  # (P,) filled rows not rescued yet
        self.occurrences: dict[tuple[int, ...], list[int]] = {}
        n = config.ngram
        for end in range(n - 1, len(prompt) - 1):  # an occurrence ending at `end` is followed by row end + 1
            self.occurrences.setdefault(tuple(prompt[end - n + 1 : end + 1]), []).append(end)
        self.rescued_rows, self.events = 0, 0

    @staticmethod
    def recurrent_late_layer(adapter, split: int) -> int | None:
        """The first recurrent layer at or above `split`, whose state cannot take a row back (the
        rescue is off for such a model), or None."""
        return next((layer for layer in range(split, adapter.num_layers) if adapter.is_recurrent(layer)), None)

    @classmethod
    def start(cls, engine, prompt: list[int], cache: KVCache, states: torch.Tensor | None, plan: PrefillPlan | None) -> "DecodeRescue | None":
        """The rescue a prefill by `plan` asks for (`PrefillPlan.rescue`), or None: no plan, no
        rescue asked, or one that cannot run (`of`). `states`: what the prefill returned beside
        the cache (`Engine.prefill_with_states`)."""
        if plan is None or plan.rescue is None or plan.is_exact(engine.num_layers):
            return None
        split = int(plan.depth.min())  # a RidgeFill plan's filled rows run exactly up to the split
        return cls.of(engine, prompt, cache, states, split, plan.rescue)[0]

    @classmethod
    def of(cls, engine, prompt: list[int], cache: KVCache, states: torch.Tensor | None, split: int,
           config: RescueConfig) -> tuple["DecodeRescue | None", str | None]:
        """The rescue for a prompt just prefilled into `cache` (alone, from position 0), or None and why not."""
        a, tokens = engine.adapter, len(prompt)
        if states is None:
            return None, "the fill kept no split-layer states (the identity fill reads none)"
        if states.shape[1] != tokens:
            raise ValueError(f"split-layer states of {states.shape[1]} rows for a {tokens}-token prompt: a plan serves the prompt it was made for")
        if cache.batch_size != 1:
            return None, "the rescue runs one sequence"
        if cache.lengths()[0] != tokens:
            return None, "the prompt continues a cached sequence: its rows are not at positions 0.."
        recurrent = cls.recurrent_late_layer(a, split)
        if recurrent is not None:
            return None, f"layer {recurrent} is recurrent: its state cannot take a row back"
        expected = torch.arange(tokens, device=cache[split].positions.device)
        for layer in range(split, a.num_layers):
            held = cache[layer].row_positions()[0]
            if held.numel() < tokens or not torch.equal(held[:tokens], expected):
                return None, f"layer {layer} does not hold every prompt row at its position (a sliding window skipped some)"
        filled = final_depth(cache, tokens) < a.num_layers
        return cls(prompt, states, filled, split, config), None

    def extend(self, tokens: list[int]) -> None:
        """Prompt text that was run without a rescue check (an evaluation's last prompt token,
        which generation prefills with the prompt): its n-grams count as prompt occurrences, as
        they would have in the prompt."""
        n = self.config.ngram
        for token in tokens:
            end = len(self.tokens) - 1
            if end >= n - 1:
                self.occurrences.setdefault(tuple(self.tokens[end - n + 1 : end + 1]), []).append(end)
            self.tokens.append(token)

    def copy(self) -> "DecodeRescue":
        """A rescue for another sample of the same prompt (its own rows pending, the states shared)."""
        other = DecodeRescue.__new__(DecodeRescue)
        other.__dict__.update(self.__dict__)
        other.tokens, other.pending, other.rescued_rows, other.events = list(self.tokens), self.pending.clone(), 0, 0
        return other

    def _rows_after(self, context: list[int]) -> list[int]:
        """The filled rows still pending after the latest occurrences of `context`'s last n-gram (sorted)."""
        n, rows = self.config.ngram, set()
        for end in self.occurrences.get(tuple(context[-n:]), [])[-self.config.recent :]:
            stop = min(end + 1 + self.config.window, self.pending.numel())
            rows.update(r for r in range(end + 1, stop) if self.pending[r])
        return sorted(rows)

    def would_rescue(self, context: list[int]) -> bool:
        """Whether feeding `context`'s last token would trigger a rescue (nothing is marked)."""
        return bool(self._rows_after(context))

    def draft_before(self, context: list[int], draft: list[int]) -> list[int]:
        """`draft` (to follow `context`) up to, not including, its first token that would trigger a
        rescue: that token comes as a later step's pending token instead."""
        tail = list(context[-self.config.ngram :])  # all an n-gram reads of the context
        for i in range(len(draft)):
            if self.would_rescue(tail + draft[: i + 1]):
                return draft[:i]
        return draft

    def due(self, context: list[int]) -> list[int]:
        """`context`'s last token (the step's pending token) is about to be fed: the filled rows
        its n-gram calls for (sorted), from here on counted as rescued."""
        rows = self._rows_after(context)
        if rows:
            self.pending[rows] = False
            self.rescued_rows += len(rows)
            self.events += 1
        return rows

    def observe(self, token: int) -> list[int]:
        """`due` for a scorer that feeds one token at a time: `token` is about to be fed."""
        self.tokens.append(token)
        return self.due(self.tokens)

    @torch.inference_mode()
    def late_layers(self, engine, cache: KVCache, rows: list[int]) -> None:
        """Layers [split, L) for `rows` of the one sequence in `cache`, from their split-layer
        states: layer by layer their keys and values replace the filled ones in place, and each
        row attends to the cache as it stands up to its own position (rescued rows included)."""
        index = torch.tensor(rows, dtype=torch.long, device=engine.device).view(1, -1)
        empty = torch.zeros(1, 0, dtype=torch.long, device=engine.device)
        engine.run_layers(self.states[:, :0], empty, cache, self.split, rewritten=RewrittenRows(self.split, self.states[:, index[0]], index, index))
