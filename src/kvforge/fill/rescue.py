"""RidgeFill's decode-time rescue: filled prompt rows recomputed when decoding starts to copy them.

A filled row's late-layer keys come from a predicted input, and what that loses most is copying
from the prompt: a copy matches the token before and reads the row after (docs/ridgefill.md:
exact keys under filled values remove most of the gap). So when the text being decoded ends in an
n-gram that also occurs in the prompt, the filled rows after its most recent occurrences are what
a copy reads next, and the next decode step recomputes them: their exact split-layer states
(kept from the prefill) join the step's token from the split on, through layers [split, L), each
row attending to the cache as it stands up to itself, as the prefill's tail-attended rows do (one
forward: the late layers' weights are read once for the step and its rescue). Their row kind stays FILLED: kinds
record what the prefill ran (`PrefillReport`), and `DecodeRescue` counts what decoding rescued.
TTFT does not change; the cost is the rescued rows' share of a late-layer forward, paid while
decoding and only when the text copies.

The rescue needs every late layer to hold every prompt row at its own position: a sliding-window
layer that skipped filled rows no exact row could see, or a recurrent layer (its state cannot
take a row back), turns it off (`DecodeRescue.of` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.attention import attend
from kvforge.cache import KVCache
from kvforge.plan import final_depth


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
    split-layer states. `decode_step` runs a decode step with the rows its token calls for
    (`observe`); `late_layers` rewrites rows, with or without a step."""

    def __init__(self, prompt: list[int], states: torch.Tensor, filled: torch.Tensor, split: int, config: RescueConfig):
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

    def observe(self, token: int) -> list[int]:
        """`token` is about to be decoded: the filled rows after the latest occurrences of the
        n-gram it ends (sorted), now counted as rescued."""
        self.tokens.append(token)
        n, rows = self.config.ngram, set()
        for end in self.occurrences.get(tuple(self.tokens[-n:]), [])[-self.config.recent :]:
            stop = min(end + 1 + self.config.window, self.pending.numel())
            rows.update(r for r in range(end + 1, stop) if self.pending[r])
        rows = sorted(rows)
        if rows:
            self.pending[rows] = False
            self.rescued_rows += len(rows)
            self.events += 1
        return rows

    def decode_step(self, engine, cache: KVCache, token: int, position: int) -> torch.Tensor:
        """The decode step of `token` at `position` (its logits, (1, V)), rescuing first the rows
        its n-gram calls for (`observe`). Rescued rows join the step from the split on, so the late
        layers' weights are read once for both: a rescue costs its rows, not a second pass."""
        rows = self.observe(token)
        if rows:
            return self.late_layers(engine, cache, rows, token, position)
        return engine.decode_step(torch.tensor([token], device=engine.device), cache, torch.tensor([position], device=engine.device))

    @torch.inference_mode()
    def late_layers(self, engine, cache: KVCache, rows: list[int], token: int | None = None, position: int | None = None):
        """Layers [split, L) for `rows` from their split-layer states, with the decode step of
        `token` (run below the split first) as the chunk's last row when given; returns its logits
        (1, V), or None. Layer by layer the rows' keys and values replace the filled ones in place
        and the token's are appended, then every query attends to the rows up to its own position as
        they stand (rescued ones included), and attention output and MLP give the next layer's input."""
        a = engine.adapter
        index = torch.tensor(rows, device=engine.device)
        h = self.states[:, index]
        positions = index.view(1, -1)
        if token is not None:
            at = torch.tensor([[position]], device=engine.device)
            below = engine.run_layers(a.embed(torch.tensor([[token]], device=engine.device)), at, cache, 0, self.split)
            h, positions = torch.cat([h, below.to(h.dtype)], dim=1), torch.cat([positions, at], dim=1)
        rope = a.rope(h, positions)
        n = len(rows)
        for layer in range(self.split, a.num_layers):
            q, k, v, gate = a.attention_inputs(layer, h, rope)
            held = cache[layer]
            held.k[:, :, index] = k[:, :, :n]
            held.v[:, :, index] = v[:, :, :n]
            if token is not None:
                held.append(k[:, :, n:], v[:, :, n:], positions[:, n:])
            o = attend(q, a.attention_view(layer, held), positions, a.scaling[layer], a.windows[layer])
            h = a.mlp_block(layer, a.attention_output(layer, h, o, gate))
        return a.head(h[:, -1:]).squeeze(1).float() if token is not None else None
