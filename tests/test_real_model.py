"""Slow tests on the packaged smollm2-135m: parity with transformers on real text."""

import pytest
import torch

from kvforge.data.prompts import held_out_text_tokens
from kvforge.engine import Engine
from kvforge.evaluate.parity import parity_prompts
from kvforge.generation import GenerationConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(real_model):
    return Engine(real_model)


def test_prefill_logits_match_transformers_on_real_text(engine):
    ids = torch.tensor([held_out_text_tokens(engine.model.tokenizer, 600)])
    logits, cache = engine.prefill(ids, logits="all", chunk_size=256)
    with torch.inference_mode():
        ref = engine.model.hf(ids).logits
    assert (logits - ref).abs().max() < 1e-3
    a = engine.adapter
    assert cache.nbytes == a.num_layers * 2 * a.kv_heads * a.head_dim * 600 * 4


def test_greedy_generation_is_token_identical_to_transformers(engine):
    hf = engine.model.hf
    for ids in parity_prompts(engine.model.tokenizer, 2):
        x = torch.tensor([ids])
        with torch.inference_mode():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False, pad_token_id=2)
        ours = engine.generate(ids, GenerationConfig(max_new_tokens=32))[0]
        assert ours.token_ids == ref[0, len(ids) :].tolist()


def test_chat_answer_is_sensible(engine):
    from kvforge.prompting import encode_prompt

    ids = encode_prompt(engine.model.tokenizer, "What is the capital of France?", chat=True)
    out = engine.generate(ids, GenerationConfig(max_new_tokens=20))[0]
    assert "Paris" in out.text


def test_cached_conversion_loads_again(real_model):
    from kvforge.models import load_model

    again = load_model("smollm2-135m", dtype="fp32")
    assert again.fingerprint == real_model.fingerprint


def test_demo_answers_a_long_real_prompt_with_every_method_and_none_degenerates(engine):
    """The demo's five rows on the packaged model: no answer repeats a word or phrase four times in
    a row, each shares content words with exact's, and drafting commits plain decoding's tokens."""
    from kvforge.demo import closing_lines, degeneration, run_demo, shared_content_words

    rows, prompt = run_demo(engine, max_new_tokens=48)
    assert rows[0].method == "exact" and rows[0].prompt_tokens > 1000 and prompt.endswith("two sentences.")
    assert [r.method.split()[0] for r in rows] == ["exact", "ridgefill", "speed", "ngram", "handoff"]
    assert "adapted" in rows[2].method and "stage 2" in rows[4].method and "ran exact" not in rows[1].method
    assert rows[3].question == "extract" and rows[3].facts["same_tokens"]
    for row in rows:
        assert row.answer and degeneration(row.answer) is None, (row.method, row.answer)
        if row.question == "summary":
            assert shared_content_words(row.answer, rows[0].answer), (row.method, row.answer)
    assert rows[4].ttft_s < rows[0].ttft_s  # the hand-off beats re-prefilling
    assert len(closing_lines(rows)) == 5


def test_drafted_seeded_sampling_of_a_bf16_group_commits_plain_sampling_tokens():
    """Eight samples of one real prompt at temperature 1 in bf16, drafting every step (no gate):
    rows accept different lengths and roll back apart, and every sample's tokens are plain seeded
    sampling's, token for token."""
    from kvforge.models import load_model
    from kvforge.speculative.rollout import DraftConfig, generate_group

    from kvforge.prompting import encode_prompt

    engine = Engine(load_model("smollm2-135m", dtype=torch.bfloat16))
    line = "the river runs down to the sea and the sea runs back to the river"
    prompt = encode_prompt(engine.model.tokenizer, f"Repeat this line three times: {line}", chat=True)
    config = GenerationConfig(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    plain, _ = generate_group(engine, prompt, 8, config, DraftConfig("none"))
    drafted, stats = generate_group(engine, prompt, 8, config, DraftConfig("ngram", k=4, gate=False))
    assert [g.token_ids for g in drafted] == [g.token_ids for g in plain]
    assert stats.accepted > 0 and len({j for j, n in enumerate(stats.accept_hist) if n}) > 1
