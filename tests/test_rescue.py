"""RidgeFill's decode-time rescue (`fill.rescue`) on tiny random models."""

from dataclasses import replace

import pytest
import torch

from conftest import tiny_loaded
from kvforge.engine import Engine
from kvforge.evaluate.ridgefill import _continuation_logits
from kvforge.fill.rescue import DecodeRescue, RescueConfig
from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan
from kvforge.generation import GenerationConfig
from test_ridgefill import _fit, _ids
from test_serve import _schedule


@pytest.fixture(scope="module")
def fitted():
    engine = Engine(tiny_loaded("llama", seed=1))
    return engine, _fit(engine, [2])


def test_observe_rescues_the_rows_after_the_latest_occurrences_once():
    prompt = [1, 5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6, 12, 13]
    filled = torch.ones(len(prompt), dtype=torch.bool)
    filled[:1] = False
    filled[13] = False  # an exact row is never rescued
    rescue = DecodeRescue(prompt, torch.zeros(1, len(prompt), 4), filled, 2, RescueConfig(ngram=2, window=2, recent=2))
    assert rescue.observe(3) == []  # the text ends (13, 3), no prompt bigram
    rescue.extend([5])
    assert rescue.observe(6) == [7, 8, 12]  # (5, 6) ends at 2, 6 and 11; after the latest two: rows 7, 8 and 12 (13 is exact)
    rescue.extend([5])
    assert rescue.observe(6) == []  # those rows are rescued already
    assert rescue.occurrences[(13, 3)] == [14] and (3, 5) not in rescue.occurrences  # extend registers the n-gram each token completes the one before
    assert (rescue.rescued_rows, rescue.events) == (3, 1)
    with pytest.raises(ValueError, match=">= 1"):
        RescueConfig(window=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_rescued_row_equals_the_row_a_prefill_keeping_it_exact_computes(family):
    engine = Engine(tiny_loaded(family, seed=1))
    maps = _fit(engine, [2])
    ids = _ids(5)
    rows = [9, 10, 11, 20]
    config = RidgeFillConfig(split=2, tail=6, sinks=2)
    plan = ridgefill_plan(engine, ids, config, maps)
    _, cache, states = engine.prefill_with_states([ids], plan=plan)
    rescue = DecodeRescue.start(engine, ids, cache, states, plan)
    assert rescue is not None
    rescue.late_layers(engine, cache, rows)
    _, kept = engine.prefill([ids], plan=ridgefill_plan(engine, ids, RidgeFillConfig(split=2, tail=6, sinks=2, rows=tuple(rows)), maps))
    for layer in range(2, engine.num_layers):
        for get in ("keys", "values"):
            torch.testing.assert_close(getattr(cache[layer], get)()[:, :, rows], getattr(kept[layer], get)()[:, :, rows], rtol=1e-4, atol=1e-5)
    others = [r for r in range(len(ids)) if r not in rows and r < 20]
    _, plain = engine.prefill([ids], plan=ridgefill_plan(engine, ids, config, maps))
    assert torch.equal(cache[3].keys()[:, :, others], plain[3].keys()[:, :, others])  # nothing else rewritten


def test_generation_with_the_rescue_is_what_its_teacher_forced_scoring_decodes(fitted):
    engine, maps = fitted
    prompt = _ids(7, 48)
    # exact rows the same in the generation's plan (P tokens) and the evaluation's (P - 1): the sinks and the last two
    config = RidgeFillConfig(split=2, tail=1, sinks=2, rows=(len(prompt) - 2,), rescue=RescueConfig(ngram=1, window=4, recent=2))
    generation = GenerationConfig(max_new_tokens=24, ignore_eos=True, logprobs=True)
    calls: dict[str, list] = {"generate": [], "score": []}
    original = DecodeRescue.due

    def recording(into):
        return lambda self, context: (lambda rows: (rows and calls[into].append(list(rows))) or rows)(original(self, context))

    try:
        DecodeRescue.due = recording("generate")
        out = engine.generate(prompt, generation, plan=ridgefill_plan(engine, prompt, config, maps))[0]
        plain = engine.generate(prompt, generation, plan=ridgefill_plan(engine, prompt, replace(config, rescue=None), maps))[0]
        DecodeRescue.due = recording("score")
        seq = prompt + out.token_ids
        plan = ridgefill_plan(engine, prompt[:-1], config, maps)  # the evaluation's: prefill all but the last prompt token
        _, cache, states = engine.prefill_with_states([prompt[:-1]], plan=plan)
        with torch.inference_mode():
            logits = _continuation_logits(engine, seq, len(prompt), cache, DecodeRescue.start(engine, prompt[:-1], cache, states, plan))
    finally:
        DecodeRescue.due = original
    assert calls["generate"] and calls["score"] == calls["generate"] and out.rescued_rows == sum(map(len, calls["generate"]))
    scored = torch.log_softmax(logits, -1)[torch.arange(len(out.token_ids)), out.token_ids]
    generated = torch.tensor([lp.model for lp in out.logprobs])
    torch.testing.assert_close(scored, generated, rtol=0, atol=1e-4)  # every token's probability, rescue for rescue
    unrescued = torch.tensor([lp.model for lp in plain.logprobs])
    n = min(len(plain.token_ids), len(out.token_ids))
    assert plain.rescued_rows is None and (generated[:n] - unrescued[:n]).abs().max() > 1e-3  # the rescue changed what was decoded


def test_no_rescue_without_maps_states_or_when_a_prompt_continues_a_cache(fitted):
    engine, maps = fitted
    ids = _ids(8)
    identity = ridgefill_plan(engine, ids, RidgeFillConfig(split=2, tail=6, fill="identity"))
    assert identity.rescue is None
    assert ridgefill_plan(engine, ids, RidgeFillConfig(split=2, tail=6, rescue=None), maps).rescue is None
    plan = ridgefill_plan(engine, ids, RidgeFillConfig(split=2, tail=6), maps)
    _, cache = engine.prefill([ids[:10]])
    _, _, states = engine.prefill_with_states([ids], cache=cache, plan=plan)
    hook, why = DecodeRescue.of(engine, ids, cache, states, 2, RescueConfig())
    assert hook is None and "continues a cached sequence" in why


def test_the_bench_times_decoding_with_and_without_the_rescue(fitted, monkeypatch):
    import kvforge.bench.ridgefill as module
    from kvforge.bench.ridgefill import bench_ridgefill

    engine, maps = fitted
    # a prompt holding nearly every token id: whatever the random model decodes occurs in it
    monkeypatch.setattr(module, "held_out_text_tokens", lambda _tokenizer, n: [3 + i % 94 for i in range(n)])
    config = RidgeFillConfig(split=2, tail=6, rescue=RescueConfig(ngram=1, window=4))
    report = bench_ridgefill(engine, maps, maps, config, [100], runs=1, decode_tokens=8)
    r = report["results"][0]
    assert r["decode_tokens"] == 8 and r["rescued_rows"] > 0 and r["rescue_decode_cost"] is not None
    assert all(r[f"{arm}_decode_tokens_per_s"] > 0 for arm in ("exact", "ridgefill_no_rescue", "ridgefill_rescue"))
    assert "decode_tokens" not in bench_ridgefill(engine, maps, maps, RidgeFillConfig(split=2, tail=6), [100], runs=1)["results"][0]


def test_a_hybrid_with_a_recurrent_late_layer_turns_the_rescue_off():
    engine = Engine(tiny_loaded("qwen3_5", seed=1))
    maps = _fit(engine, [1])
    ids = _ids(9)
    plan = ridgefill_plan(engine, ids, RidgeFillConfig(split=1, tail=6, sinks=2), maps)
    _, cache, states = engine.prefill_with_states([ids], plan=plan)
    hook, why = DecodeRescue.of(engine, ids, cache, states, 1, RescueConfig())
    assert hook is None and "recurrent" in why and DecodeRescue.start(engine, ids, cache, states, plan) is None
    out = engine.generate(ids, GenerationConfig(max_new_tokens=4, ignore_eos=True), plan=ridgefill_plan(engine, ids, RidgeFillConfig(split=1, tail=6, sinks=2), maps))[0]
    assert out.rescued_rows is None and len(out.token_ids) == 4


# --- one decode loop: the rescue in every path ------------------------------------------------
RESCUING = RidgeFillConfig(split=2, tail=1, sinks=2, rescue=RescueConfig(ngram=1, window=4, recent=2))
GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)
# sampled: a tiny random model's greedy text repeats one token, which triggers one rescue; drawn
# text triggers many, and drafts cross them
SAMPLED = replace(GREEDY, temperature=1.0, seed=3)


def _every_id(seed: int, t: int = 96) -> list[int]:
    """A prompt holding every token id of the tiny vocabulary: whatever is decoded occurs in it."""
    ids = torch.randperm(97, generator=torch.Generator().manual_seed(seed)).tolist()
    return (ids * 2)[:t]


class Oracle:
    """Drafts the continuation of a known output: every draft crosses whatever it crosses."""

    source = "oracle"

    def __init__(self, prompt, output):
        self.text = list(prompt) + list(output)

    def propose(self, context, k):
        return self.text[len(context) : len(context) + k] if self.text[: len(context)] == context else []

    def observe(self, tokens):
        pass


@pytest.mark.parametrize("generation", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_drafted_ridgefill_commits_plain_ridgefills_tokens_and_rescues_the_same_rows(fitted, generation):
    """Drafts that cross a token triggering a rescue end before it, so every position sees the rows
    plain decoding shows it: the same tokens, rows and log-probabilities, all drafted right."""
    from kvforge.speculative.decode import speculative_generate

    engine, maps = fitted
    logprobs = replace(generation, logprobs=True)
    for seed in (7, 8):
        prompt = _every_id(seed)
        plain = engine.generate(prompt, logprobs, plan=ridgefill_plan(engine, prompt, RESCUING, maps))[0]
        (drafted,), stats = speculative_generate(engine, [prompt], [Oracle(prompt, plain.token_ids)], logprobs, k=8,
                                                 plan=ridgefill_plan(engine, prompt, RESCUING, maps))
        assert plain.rescued_rows > 0 and drafted.token_ids == plain.token_ids and drafted.rescued_rows == plain.rescued_rows
        assert stats.accepted == stats.drafted > 0 and stats.steps < len(plain.token_ids) - 1
        torch.testing.assert_close(torch.tensor([lp.model for lp in drafted.logprobs]), torch.tensor([lp.model for lp in plain.logprobs]),
                                   rtol=0, atol=1e-4)


def test_a_draft_ends_before_the_token_that_would_trigger_a_rescue(fitted):
    prompt = [1, 5, 6, 7, 8, 9, 10]
    filled = torch.ones(len(prompt), dtype=torch.bool)
    rescue = DecodeRescue(prompt, torch.zeros(1, len(prompt), 4), filled, 2, RescueConfig(ngram=1, window=2, recent=1))
    context = prompt + [3]
    assert rescue.draft_before(context, [4, 2, 6, 11]) == [4, 2]  # 6 occurs in the prompt, rows 3 and 4 after it are pending
    assert rescue.due(context + [4, 2, 6]) == [3, 4] and rescue.draft_before(context, [4, 2, 6, 11]) == [4, 2, 6, 11]


@pytest.mark.parametrize("generation", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_served_ridgefill_decodes_what_generate_does_plain_and_drafted_alone_and_batched(fitted, generation):
    """The server's RidgeFill requests, each with its own rescue in the batch, decode the tokens
    `generate --method ridgefill` decodes, beside exact and SPEED requests and each other."""
    from kvforge.fill.speed import SpeedConfig, speed_plan
    from kvforge.serve.app import planned_prefiller
    from kvforge.serve.scheduler import ServeRequest

    engine, maps = fitted
    speed = SpeedConfig(cut=2, first=1, tail=3)
    plans = {"exact": lambda ids: None, "ridgefill": lambda ids: ridgefill_plan(engine, ids, RESCUING, maps),
             "speed": lambda ids: speed_plan(len(ids), speed, engine.num_layers)}
    prefillers = {method: planned_prefiller(engine, make) for method, make in plans.items()}
    prompts = {"ridgefill": [_every_id(7), _every_id(8, 120)], "exact": [_ids(9, 30)], "speed": [_ids(10, 36)]}
    expected = {(m, i): engine.generate(p, generation, plan=plans[m](p))[0] for m, ps in prompts.items() for i, p in enumerate(ps)}
    assert all(expected[("ridgefill", i)].rescued_rows > 0 for i in range(2))
    for draft in ("none", "ngram"):
        alone = [ServeRequest(prompts["ridgefill"][0], generation, prefill="ridgefill", draft=draft)]
        _schedule(engine, [alone], prefillers=prefillers)
        assert alone[0].seq.token_ids == expected[("ridgefill", 0)].token_ids, draft
        batch = {(m, i): ServeRequest(p, generation, prefill=m, draft=draft) for m, ps in prompts.items() for i, p in enumerate(ps)}
        _schedule(engine, list(batch.values()), prefillers=prefillers)
        for name, r in batch.items():
            assert r.seq.token_ids == expected[name].token_ids, (draft, name)
        assert batch[("ridgefill", 1)].state.rescue.rescued_rows == expected[("ridgefill", 1)].rescued_rows


def test_vllms_rescue_book_follows_a_request_by_its_steps_and_drops_another_requests():
    """The vLLM class's book of rescues by first block: a request's steps continue where its last
    left off (a verification's rejected drafts overwritten); a step that does not (another request
    loaded onto the block) drops the entry instead of rescuing from a stranger's history."""
    from kvforge.vllm.rescue import RescueBook

    prompt = [1, 5, 6, 7, 8, 9, 10]
    config = RescueConfig(ngram=1, window=1, recent=1)
    book = RescueBook(limit=4)
    book.start(3, DecodeRescue(prompt, None, torch.ones(len(prompt), dtype=torch.bool), 2, config))
    assert book.due(3, 7, [11]) is None  # the first decode step: 11 is not in the prompt
    _, rows = book.due(3, 8, [6, 7, 2])  # pending 6 (row 3 follows it), drafts 7 and 2
    assert rows == [3]
    rescue, rows = book.due(3, 9, [8])  # the drafts rejected: the bonus 8 takes position 9
    assert rows == [5] and rescue.tokens == prompt + [11, 6, 8]
    assert book.due(3, 40, [6]) is None and 3 not in book.by_block  # not this request's next step
    book.start(3, None)  # a prompt prefilled exactly on the block
    assert book.due(3, 8, [6]) is None
