"""The vLLM proposer's bookkeeping, driven by hand the way vLLM calls it (no engine needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")  # kvforge.vllm imports vLLM's types

from kvforge.speculative.ngram import NgramCache  # noqa: E402
from kvforge.vllm.proposer import NgramRLProposer, ProposerConfig  # noqa: E402

MAX_LEN = 64


def fake_vllm_config(k: int = 4, max_num_seqs: int = 2):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )


class Batch:
    """vLLM's input batch as the proposer sees it: rows of committed tokens, reordered at will."""

    def __init__(self):
        self.rows: list[list[int]] = []

    def call(self, proposer, sampled: list[list[int]]):
        for row, new in zip(self.rows, sampled):
            row.extend(new)
        ids = np.zeros((max(len(self.rows), 1), MAX_LEN), dtype=np.int32)
        lengths = np.zeros(max(len(self.rows), 1), dtype=np.int32)
        for i, row in enumerate(self.rows):
            ids[i, : len(row)] = row
            lengths[i] = len(row)
        return proposer.propose(sampled, lengths, ids)


def test_drafts_follow_the_shared_prompt_cache_across_row_moves():
    proposer = NgramRLProposer(fake_vllm_config(), ProposerConfig(k=4, gate=False))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    batch = Batch()
    batch.rows = [list(prompt), list(prompt)]  # two samples of one prompt (n=2)
    drafts = batch.call(proposer, [[8], [8]])  # the first token of each
    assert drafts == [[9, 5, 6, 7]] * 2  # 5 6 7 8 -> 9 5 6 7, from the prompt
    assert proposer.stats.new_rows == 2 and len(proposer.history) == 1  # one cache for the prompt
    batch.rows.reverse()  # vLLM condensed the batch: rows swapped places
    drafts = batch.call(proposer, [[9, 5, 11], [9, 5, 6, 7, 8]])  # accepted 2 then bonus 11; all 4 then 8
    assert proposer.stats.new_rows == 2  # both found again by content
    assert proposer.stats.accepted == 2 + 4 and proposer.stats.drafted == 8
    cache = proposer.history.get(prompt)
    reference = NgramCache(prompt, 2, 4)
    for row in batch.rows:
        reference.add(row[len(prompt):], prompt)
    counts = lambda c: {gram: {t: entry[0] for t, entry in followers.items()} for gram, followers in c.table.items()}
    assert counts(cache) == counts(reference)  # every committed token indexed exactly once
    assert drafts[1] == cache.draft(batch.rows[1], 4)


def test_a_later_row_of_a_prompt_drafts_along_an_earlier_rows_output():
    """Each row's output is one of its prompt's rollouts: epoch 2's row follows the earlier row
    whose output begins as its own does."""
    proposer = NgramRLProposer(fake_vllm_config(k=4), ProposerConfig(k=4, gate=False))
    prompt = [5, 6, 7, 8]
    batch = Batch()
    batch.rows = [list(prompt), list(prompt)]
    batch.call(proposer, [[20], [40]])
    batch.call(proposer, [[21, 22, 23], [41, 42, 43]])  # epoch 1: two samples
    assert sorted(proposer.history.previous(prompt).values()) == [[20, 21, 22, 23], [40, 41, 42, 43]]
    batch.rows = [list(prompt)]  # they finished; epoch 2 samples the prompt again
    assert batch.call(proposer, [[40]]) == [[41, 42, 43]]
    state = next(s for states in proposer.rows.values() for s in states if s.output == [40])
    assert state.drafter.source == "rollout"
    batch.call(proposer, [[41, 42, 99]])  # two of its three accepted, then the bonus
    tallies = proposer.stats.by_source()
    assert tallies["sources"]["rollout"] == [1, 3, 2]
    assert tallies["matched"]["rollout"][1] >= 2  # every proposal is scored, verified or not


def test_prefilling_rows_get_no_draft_and_room_stops_at_max_len():
    proposer = NgramRLProposer(fake_vllm_config(), ProposerConfig(k=4, gate=False))
    batch = Batch()
    batch.rows = [[1, 2, 3, 1, 2], [3] * (MAX_LEN - 3)]
    drafts = batch.call(proposer, [[], [3]])  # row 0 still prefilling
    assert drafts[0] == [] and len(drafts[1]) == 2  # MAX_LEN - 62 tokens of room


def test_finished_rows_are_forgotten_within_the_bound():
    proposer = NgramRLProposer(fake_vllm_config(max_num_seqs=2), ProposerConfig(k=4))
    rng = np.random.default_rng(0)
    for request in range(100):  # 100 requests come and go, two at a time
        batch = Batch()
        batch.rows = [rng.integers(3, 90, size=6).tolist() for _ in range(2)]
        for _ in range(3):
            batch.call(proposer, [[int(rng.integers(3, 90))] for _ in batch.rows])
    assert len(proposer.rows) <= proposer.max_rows


def test_bad_settings_are_refused_before_vllm_starts():
    from kvforge.vllm import speculative_config

    with pytest.raises(ValueError, match="unknown kvforge proposer setting"):
        speculative_config(k=4, ngram_size=3)
    with pytest.raises(ValueError, match="n_min"):
        speculative_config(k=4, n_min=5, n_max=2)
    with pytest.raises(ValueError, match="drafts 3 tokens, vLLM verifies 4"):
        NgramRLProposer(fake_vllm_config(k=4), ProposerConfig(k=3))


def test_the_gate_returns_no_draft_while_it_does_not_pay_and_keeps_learning():
    """vLLM's step measured at 10 ms plain, 5 ms more per draft token, drafts rarely right: nothing is
    returned, but each proposal is scored against what the row committed; once the proposals
    would have landed, the row drafts again."""
    proposer = NgramRLProposer(fake_vllm_config(), ProposerConfig(k=4))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    batch = Batch()
    batch.rows = [list(prompt)]
    state_of = lambda: proposer.rows[hash(np.asarray(batch.rows[0], dtype=np.int32).tobytes())][0]
    cost = proposer.gate.cost
    context = len(prompt) + 1
    for width in range(1, 6):
        cost.record(1, width, context, 0.010 + 0.005 * (width - 1), 0.0)
    proposer._last_step = None  # the wall time between these hand-made calls is not vLLM's
    assert batch.call(proposer, [[8]]) == [[]]  # even odds of landing: not worth 5 ms a token
    state = state_of()
    assert state.proposal == [9, 5, 6, 7]  # proposed, not returned
    proposer._last_step = None
    batch.call(proposer, [[40]])  # not what was proposed
    low = state_of().acceptance.rate
    assert low < 0.3
    for token in (5, 6):  # back on the prompt's n-grams
        proposer._last_step = None
        batch.call(proposer, [[token]])
    for _ in range(6):  # the row writes exactly what the prompt cache proposes
        proposer._last_step = None
        drafts = batch.call(proposer, [[state_of().proposal[0]]])
        if drafts[0]:
            break
    assert state_of().acceptance.rate > 0.5 and drafts[0]  # it drafts again


def test_a_ridgefill_prompts_drafts_end_before_a_token_that_would_trigger_a_rescue():
    """For a prompt the RidgeFill class published, the proposer follows the rescue schedule over
    every committed token and ends a draft before a token that would trigger a rescue; once the
    rows are rescued, the same token is drafted again. Another prompt's drafts are not cut."""
    import torch

    from kvforge.fill.rescue import RescueConfig
    from kvforge.vllm import rescue

    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    filled = torch.zeros(len(prompt), dtype=torch.bool)
    filled[6] = True  # the row after the last 5: a 5 decoded calls for it
    rescue.publish(prompt, filled, 2, RescueConfig(ngram=1, window=1, recent=1))
    runs = {}
    try:
        for first in (5, 4):  # the published prompt, and one that was not filled
            proposer = NgramRLProposer(fake_vllm_config(), ProposerConfig(k=4, gate=False))
            batch = Batch()
            batch.rows = [[first] + prompt[1:]]
            runs[first] = [batch.call(proposer, [[8]]), batch.call(proposer, [[9, 5]])]
            if first == 5:
                assert proposer.stats.rescue_cuts == 1
    finally:
        rescue._SCHEDULES.clear()
    assert runs[4][0] == [[9, 5, 6, 7]] and runs[5][0] == [[9]]  # 5 would trigger the rescue: it comes as the pending token
    assert runs[5][1] == runs[4][1] and runs[5][1][0][:1] == [6]  # 9 then the pending 5 committed, row 6 rescued: no cut
