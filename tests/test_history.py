"""Rollout history: the per-prompt store's bound and LRU eviction, its files (round trip, damaged
or foreign files ignored with a warning), drafting from a prompt's own history only, greedy
identity with plain decoding whatever the history holds, the length-aware budget, previous
rollouts as drafts (the alignment, own sample first, fresh and coupled epochs), and `bench
rollout` on a tiny model."""

import json
import threading
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from conftest import tiny_loaded
from kvforge.cli import app
from kvforge.provenance import portable_path
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig
from kvforge.speculative.decode import speculative_generate
from kvforge.speculative.history import RolloutHistory, prompt_key
from kvforge.speculative.ngram import NgramCache, NgramDrafter
from kvforge.speculative.previous import IndexedRollout, PreviousRolloutDrafter
from kvforge.speculative.rollout import DraftConfig, generate_group
from kvforge.speculative.step import new_drafters

A = [5, 6, 7, 5, 6, 7, 5, 6, 8]
B = [9, 10, 11, 9, 10, 12]


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_loaded("llama"))


def _grown(history: RolloutHistory, prompt: list[int], tokens: list[int]):
    cache = history.get(prompt)
    cache.add(tokens, prompt)
    history.settle(prompt)
    return cache


# --- the store ---------------------------------------------------------------------------------
def test_the_store_evicts_least_recently_used_prompts_beyond_its_bound():
    history = RolloutHistory(2, 2, max_entries=40)
    prompts = [[p, p + 1, p + 2] for p in (10, 20, 30)]
    for p in prompts:
        _grown(history, p, list(range(p[0] + 50, p[0] + 60)))  # 2 + 10 pairs each
    assert history.entries <= 40 and len(history) == 3
    history.get(prompts[0])  # used again: now the most recent
    _grown(history, [40, 41, 42], list(range(90, 100)))
    assert history.entries <= 40
    assert prompt_key(prompts[1]) not in history.caches  # the least recently used went first
    assert prompt_key(prompts[0]) in history.caches and prompt_key([40, 41, 42]) in history.caches
    # a prompt whose history alone exceeds the bound starts over from its prompt
    big = _grown(history, prompts[0], list(range(3, 60)))
    assert big.entries > 40 and history.get(prompts[0]).entries == 1 and history.entries <= 40


def test_a_history_file_round_trips_and_drafts_as_the_cache_did(tmp_path):
    history = RolloutHistory(1, 3, directory=tmp_path)
    cache = _grown(history, A, [8, 5, 6, 9, 5, 6, 8, 5])
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [f"{prompt_key(A)}.safetensors"]  # one file per prompt, no temp file left
    again = RolloutHistory(1, 3, directory=tmp_path).get(A)
    assert again is not cache and again.table == cache.table
    assert (again.clock, again.entries) == (cache.clock, cache.entries)
    assert again.draft([5, 6], 6) == cache.draft([5, 6], 6)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "another prompt", "other n-gram sizes"])
def test_a_damaged_or_foreign_history_file_is_ignored_with_one_warning_naming_it(tmp_path, damage):
    source = RolloutHistory(2, 4, directory=tmp_path)
    _grown(source, A, [40, 41, 42, 43])
    _grown(source, B, [50, 51, 52, 53])
    path_a, path_b = source.path(prompt_key(A)), source.path(prompt_key(B))
    sizes = (2, 4)
    if damage == "garbage":
        path_a.write_bytes(b"not a safetensors file")
    elif damage == "truncated":
        path_a.write_bytes(path_a.read_bytes()[:-20])
    elif damage == "another prompt":
        path_a.write_bytes(path_b.read_bytes())  # B's history under A's key: never lent to A
    else:
        sizes = (1, 4)
    messages = []
    cache = RolloutHistory(*sizes, directory=tmp_path, warn=messages.append).get(A)
    assert len(messages) == 1 and str(path_a) in messages[0], messages
    assert cache.table == NgramCache(A, *sizes).table  # fresh: the prompt's n-grams only
    with warnings.catch_warnings(record=True) as caught:  # the library default: a Python warning
        warnings.simplefilter("always")
        RolloutHistory(*sizes, directory=tmp_path).get(A)
    assert len(caught) == 1 and str(path_a) in str(caught[0].message)


def test_a_history_directory_that_is_a_file_is_a_clear_error(tmp_path):
    from kvforge.errors import KvforgeError

    (tmp_path / "f").write_text("x")
    with pytest.raises(KvforgeError, match="is a file"):
        RolloutHistory(directory=tmp_path / "f")


# --- drafting from history: the same prompt only, and lossless ----------------------------------
def test_a_prompt_drafts_from_its_own_history_only(engine):
    history = RolloutHistory(2, 4)
    sampled = GenerationConfig(max_new_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    outputs, _ = generate_group(engine, A, 3, sampled, DraftConfig(), history=history)
    a_cache = history.get(A)
    assert a_cache.entries > 2 * len(A) and all(a_cache.successors(g.token_ids[:2]) for g in outputs)  # its rollouts are in it
    b_cache = history.get(B)
    assert b_cache is not a_cache and b_cache.table == NgramCache(B, 2, 4).table  # B's prompt n-grams only
    assert history.get(A) is a_cache  # the same prompt finds its history again


def test_greedy_with_a_prefilled_history_commits_the_plain_tokens(engine):
    """History from sampled rollouts of the prompt, and junk: greedy drafting from it commits
    plain decoding's tokens, with a fixed k and with the length-aware budget."""
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    plain = engine.generate(A, config)[0].token_ids
    history = RolloutHistory(2, 4)
    sampled = GenerationConfig(max_new_tokens=24, temperature=1.0, seed=1, ignore_eos=True)
    generate_group(engine, A, 4, sampled, DraftConfig(), history=history)
    generate_group(engine, A, 1, config, DraftConfig(gate=False), history=history)  # the greedy answer is in the history now
    history.get(A).add([3, 4, 3, 4, 3, 4] * 4, A)  # and junk
    for draft in (DraftConfig(k=5, gate=False), DraftConfig(k=8, k_min=1, k_ramp=4, gate=False)):
        outputs, stats = generate_group(engine, A, 2, config, draft, history=history)
        assert [g.token_ids for g in outputs] == [plain, plain]
        assert stats.accepted > 0  # drafts from the history were verified and accepted


def test_the_length_aware_budget_grows_with_the_tokens_produced(engine):
    draft = DraftConfig(k=8, k_min=2, k_ramp=16)
    assert [draft.k_for(t) for t in (0, 15, 16, 47, 48, 500)] == [2, 2, 3, 4, 5, 8]
    assert DraftConfig(k=8).k_for(0) == 8
    with pytest.raises(ValueError):
        DraftConfig(k=4, k_min=5)
    asked = []  # (tokens produced, draft length asked for)

    class Recording:
        def propose(self, context, k):
            asked.append((len(context) - len(A), k))
            return [3] * k

        def observe(self, tokens):
            pass

    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    ramp = DraftConfig(k=6, k_min=1, k_ramp=4)
    out, _ = speculative_generate(engine, [A], [Recording()], config, 6, k_for=ramp.k_for)
    assert out[0].token_ids == engine.generate(A, config)[0].token_ids
    assert all(k <= ramp.k_for(produced) for produced, k in asked)
    assert asked[0][1] == 1 and max(k for _, k in asked) == 6


def test_the_scheduler_keeps_a_prompts_history_across_requests(engine):
    """A second request with the same prompt drafts from the first's choices (one cache, holding
    their outputs); another prompt gets its own; greedy choices commit plain decoding's tokens;
    a request that opts out gets a cache of its own."""
    from kvforge.serve.scheduler import Scheduler, ServeRequest

    greedy = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    scheduler = Scheduler(engine, {"exact": lambda r: (*engine.prefill([r.prompt_ids]), None)}, max_batch=4, history=RolloutHistory(2, 4),
                          draft=DraftConfig(gate=False)).start()  # every draft verified: what lands is not up to the gate's timings
    try:
        def run(group):
            done = threading.Semaphore(0)
            for r in group:
                r.emit = lambda kind, payload: done.release() if kind == "done" else None
            scheduler.submit(group)
            for _ in group:
                assert done.acquire(timeout=120)
            assert all(r.error is None for r in group)
            return group

        first = run([ServeRequest(A, greedy, draft="ngram") for _ in range(2)])
        second = run([ServeRequest(A, greedy, draft="ngram")])
        other = run([ServeRequest(B, greedy, draft="ngram")])
        apart = run([ServeRequest(A, greedy, draft="ngram", history=False)])
    finally:
        scheduler.stop()
    cache = first[0].state.drafter.cache
    assert second[0].state.drafter.cache is cache and cache.successors(A[-2:] + first[0].seq.token_ids[:1]) != []
    assert other[0].state.drafter.cache is not cache and apart[0].state.drafter.cache is not cache
    assert second[0].state.accepted > 0  # it drafted the first request's answer
    plain = engine.generate(A, greedy)[0].token_ids
    assert [r.seq.token_ids for r in first + second + apart] == [plain] * 4


# --- the CLI and the bench ------------------------------------------------------------------------
def test_rollout_history_persists_across_cli_calls(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("abc abc abc\nhello there\n")
    args = ["rollout", "-m", str(tiny_model_dir), "--prompts", str(prompts), "-G", "2", "-n", "12", "--no-chat", "--seed", "1",
            "--history", str(tmp_path / "h"), "--out", str(tmp_path / "r.jsonl"), "--no-gate", "--json"]  # what lands: not the gate's timings
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    files = sorted((tmp_path / "h").iterdir())
    assert len(files) == 2 and json.loads(first.stdout.strip().splitlines()[-1])["history"] == portable_path(str(tmp_path / "h"))
    samples = lambda: [json.loads(line)["token_ids"] for line in (tmp_path / "r.jsonl").read_text().splitlines()]  # noqa: E731
    rollouts = samples()
    files[0].write_bytes(b"damaged")
    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0, second.output
    assert "warning" in second.stderr and str(files[0]) in second.stderr.replace("\n", "")
    assert files[0].read_bytes()[:8] != b"damaged"  # rewritten whole
    # the same seed and epoch: the same samples, the undamaged prompt's drafted from its previous rollouts
    assert samples() == rollouts
    assert json.loads(second.stdout.strip().splitlines()[-1])["accept_by_source"]["rollout"]["accepted"] > 0
    fresh = CliRunner().invoke(app, args + ["--epoch", "1"])
    assert fresh.exit_code == 0 and json.loads(fresh.stdout.strip().splitlines()[-1])["epoch"] == 1
    assert samples() != rollouts  # a new epoch draws new samples


def test_bench_rollout_reports_epochs_and_arms(tiny_model_dir, monkeypatch):
    import kvforge.bench.rollout as bench

    short = [torch.randint(3, 9, (30,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    monkeypatch.setattr(bench, "rl_prompts", lambda tok, count: short[:count])
    report = bench.bench_rollout(str(tiny_model_dir), n=2, epochs=2, runs=1, prompts=2, max_tokens=8, k=4, k_min=1)
    assert report["command"] == "bench rollout" and report["n"] == 2
    rows = {(r["epoch"], r["arm"]): r for r in report["results"]}
    assert set(rows) == {(e, a) for e in (1, 2) for a in ("plain", "ngram", "ngram-ramp")}
    for (epoch, arm), r in rows.items():
        assert {"epoch", "arm", "tokens", "tokens_per_s", "speedup_vs_plain", "lossless", "mean_accept_len"} <= set(r)
        assert r["tokens_per_s"] > 0 and 0 < r["completion_tokens"] <= 2 * 2 * 8
        if arm != "plain":
            assert r["lossless"] is True and r["mean_accept_len"] >= 0
    assert rows[(1, "ngram")]["history_entries"] == 0 < rows[(2, "ngram")]["history_entries"]


# --- previous rollouts as drafts ---------------------------------------------------------------
def test_a_previous_rollout_drafts_along_while_the_sample_follows_it_and_realigns_after():
    prompt = [1, 2, 3]
    own, sibling = [10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 13, 14, 17]
    drafter = PreviousRolloutDrafter([own, sibling], len(prompt))
    assert drafter.propose(prompt, 3) == [10, 11, 12]  # its own previous rollout, from the start
    drafter.observe([10, 11])
    assert drafter.propose(prompt + [10, 11], 3) == [12, 13, 14]
    drafter.observe([99])  # left it: nothing begins with 10 11 99, no recent match either
    assert drafter.propose(prompt + [10, 11, 99], 3) == []
    drafter.observe([13, 14])  # back on a text both rollouts hold: the nearest occurrence wins
    assert drafter.propose(prompt + [10, 11, 99, 13, 14], 2) == [15, 16]
    fresh = PreviousRolloutDrafter([own, sibling], len(prompt))
    fresh.observe([20])  # its own rollout began otherwise; the sibling's begins with its output
    assert fresh.propose(prompt + [20], 2) == [21, 22]
    assert PreviousRolloutDrafter([], 3).propose(prompt, 4) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=12), min_size=1, max_size=4), st.lists(st.integers(0, 4), min_size=1, max_size=10))
def test_realigning_finds_the_rule_s_alignment(rollouts, output):
    """The indexed search gives what the rule says, by brute force: a rollout (in order) beginning
    with the whole output, else the longest recent n-gram, in the first rollout holding it with a
    token after it, at the occurrence ending nearest the output's length."""
    prompt = [9, 9]
    context = prompt + output
    kept = [r for r in rollouts if r]

    def reference():
        for i, r in enumerate(kept):
            if len(r) > len(output) and r[: len(output)] == output:
                return r[len(output):][:3]
        for n in range(min(4, len(context)), 1, -1):
            for r in kept:
                ends = [e for e in range(n, len(r)) if r[e - n : e] == context[-n:]]
                if ends:
                    end = min(ends, key=lambda e: abs(e - len(output)))
                    return r[end:][:3]
        return []

    drafter = PreviousRolloutDrafter(rollouts, len(prompt))
    drafter.aligned = None  # search now, as after a miss
    assert drafter.propose(context, 3) == reference()


def test_a_groups_drafters_share_each_previous_rollouts_index():
    """Sample i drafts from its own previous rollout first, the others in index order, and every
    drafter of the group reads one index per previous rollout: built once, by whichever sample
    searches first."""
    prompt = [1, 2, 3]
    previous = {0: [10, 11, 12, 13], 1: [20, 12, 13, 21], 2: [30, 12, 13, 32]}
    drafters, _ = new_drafters(DraftConfig("ngram", 4), prompt, 3, previous=previous)
    orders = [d.drafters["rollout"].indexed for d in drafters]
    assert [[r.tokens.tolist() for r in order] for order in orders] == [
        [previous[0], previous[1], previous[2]], [previous[1], previous[0], previous[2]], [previous[2], previous[0], previous[1]]]
    assert all(orders[0][0] is order[next(i for i, r in enumerate(order) if r.tokens.tolist() == previous[0])] for order in orders)
    output = [99, 12, 13]  # no rollout begins with 99: each drafter searches by n-gram
    found = []
    for d in drafters:
        rollout = d.drafters["rollout"]
        rollout.observe(output)
        found.append(rollout.propose(prompt + output, 2))
    # its own rollout first where it holds 12 13 with a token after; sample 0's ends there, so sample 1's
    assert found == [[21], [21], [32]]
    built = {id(r) for order in orders for r in order if r._grams is not None}
    assert built == {id(r) for r in orders[0]}  # the three indexes, each built once for the group
    with pytest.raises(ValueError, match="indexed by other n-grams"):
        PreviousRolloutDrafter([IndexedRollout([1, 2, 3], 1, 3)], 2)


def test_the_drafter_takes_the_previous_rollout_source_and_reports_it():
    prompt = [1, 2, 3]
    drafter = NgramDrafter(NgramCache(prompt, 2, 4), prompt, [[7, 8, 9, 7, 8]])
    assert drafter.propose(prompt, 4) == [7, 8, 9, 7] and drafter.source == "rollout"
    drafter.observe([7, 8, 9])
    assert drafter.propose(prompt + [7, 8, 9], 4) == [7, 8] and drafter.chosen["rollout"] == 2
    assert NgramDrafter(NgramCache(prompt, 2, 4), prompt).propose(prompt, 4) == []


def test_history_keeps_each_samples_latest_rollout_by_key_on_disk(tmp_path):
    history = RolloutHistory(2, 4, directory=tmp_path)
    history.get(A, "task-1")
    history.record(A, 0, [1, 2, 3], "task-1")
    history.record(A, 1, [4, 5], "task-1")
    history.record(A, 0, [6], "task-1")  # the latest replaces the one before
    history.settle(A, "task-1")
    assert history.previous(A, "task-1") == {0: [6], 1: [4, 5]} and history.previous(A) == {}
    again = RolloutHistory(2, 4, directory=tmp_path)
    assert again.previous(B, "task-1") == {0: [6], 1: [4, 5]}  # a rollout key names the rollout whatever the prompt
    assert again.entries == again.get(B, "task-1").entries + 3  # the bound counts the rollouts' tokens
    assert again.previous(B, "unknown") == {}  # an unknown key: nothing to draft from


def test_a_group_drafts_from_its_previous_epoch_and_commits_the_plain_samples(engine):
    """Epoch 2 of a prompt drafts from epoch 1's rollouts: with coupled noise (the epoch left
    out of the key) and unchanged weights every sample replays its own previous rollout, drafted
    nearly whole; with fresh noise (a new epoch) the samples are new draws. Either way the tokens
    are plain sampling's with the same key."""
    prompt = [4, 7, 9, 4, 7]
    history = RolloutHistory(2, 4)
    # every proposal verified (no cost gate): what is drafted and accepted must not hang on timings
    draft, plain = DraftConfig("ngram", 6, gate=False), DraftConfig("none", 6)
    config = lambda epoch: GenerationConfig(24, temperature=1.0, seed=3, epoch=epoch, ignore_eos=True)  # noqa: E731
    first, _ = generate_group(engine, prompt, 4, config(0), plain, history=history)  # a plain epoch leaves its rollouts too
    assert history.previous(prompt) == {i: g.token_ids for i, g in enumerate(first)}
    coupled, stats = generate_group(engine, prompt, 4, config(0), draft, history=history)
    assert [g.token_ids for g in coupled] == [g.token_ids for g in first]
    assert stats.accept_by_source["rollout"]["accept_rate"] == 1.0 and stats.mean_accept_len > 3
    # with the prefetcher: its tables hold the n-gram chain's drafts, so they are built only for rows
    # drafting from the chain, and the previous rollouts keep drafting where they win
    again, prefetched = generate_group(engine, prompt, 4, config(0), DraftConfig("ngram", 6, prefetch=True, gate=False), history=history)
    assert [g.token_ids for g in again] == [g.token_ids for g in first]
    by_source = prefetched.accept_by_source
    assert by_source["rollout"]["rows"] > by_source.get("prefetch", {"rows": 0})["rows"] and prefetched.mean_accept_len > 3
    fresh, fresh_stats = generate_group(engine, prompt, 4, config(1), draft, history=history)
    reference, _ = generate_group(engine, prompt, 4, config(1), plain)
    assert [g.token_ids for g in fresh] == [g.token_ids for g in reference] != [g.token_ids for g in first]
    assert set(fresh_stats.accept_by_source) <= {"rollout", "chain", "lookup"}
