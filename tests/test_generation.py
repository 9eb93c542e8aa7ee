"""generate(): max tokens, EOS, stop strings, streaming, seeds, context and prompt checks."""

import pytest
import torch

from conftest import tiny_loaded
from kvforge.engine import Engine
from kvforge.errors import PromptError
from kvforge.generation import GenerationConfig

PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_loaded("llama"))


def _free_run(engine, n=30):
    return engine.generate(PROMPT, GenerationConfig(max_new_tokens=n, ignore_eos=True))[0]


def test_max_new_tokens_and_length_finish(engine):
    out = _free_run(engine, 7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.prompt_tokens == len(PROMPT)
    assert out.ttft_s > 0 and out.decode_tokens_per_s > 0


def test_eos_stops_and_is_kept_in_ids(engine):
    free = _free_run(engine)
    eos = free.token_ids[4]
    first = free.token_ids.index(eos)
    old = engine.model.hf.generation_config.eos_token_id
    engine.model.hf.generation_config.eos_token_id = eos
    try:
        out = engine.generate(PROMPT, GenerationConfig(max_new_tokens=30))[0]
    finally:
        engine.model.hf.generation_config.eos_token_id = old
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_stop_string_truncates_text_and_streams_consistently(engine):
    free = _free_run(engine)
    stop = free.text[6:8]
    at = free.text.find(stop)
    pieces = []
    out = engine.generate(
        PROMPT, GenerationConfig(max_new_tokens=30, stop=(stop,), ignore_eos=True), on_text=lambda i, d: pieces.append(d)
    )[0]
    assert out.text == free.text[:at]
    assert out.finish_reason == "stop" and out.stop_matched == stop
    assert "".join(pieces) == out.text


def test_streaming_without_stop_yields_the_whole_text(engine):
    pieces = []
    out = engine.generate(PROMPT, GenerationConfig(max_new_tokens=15, ignore_eos=True), on_text=lambda i, d: pieces.append(d))[0]
    assert "".join(pieces) == out.text and len(pieces) > 1


def test_seeded_sampling_is_repeatable_and_differs_by_seed(engine):
    def run(seed):
        return engine.generate(PROMPT, GenerationConfig(max_new_tokens=20, temperature=1.5, seed=seed, ignore_eos=True))[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_prompt_longer_than_context_names_both_lengths(engine):
    context = engine.model.context_length
    with pytest.raises(PromptError, match=f"{context + 5}.*{context}"):
        engine.generate([5] * (context + 5), GenerationConfig(max_new_tokens=2))


def test_generation_stops_at_the_context_end(engine):
    context = engine.model.context_length
    prompt = [5] * (context - 3)
    out = engine.generate(prompt, GenerationConfig(max_new_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_empty_prompt_is_rejected(engine):
    with pytest.raises(PromptError, match="empty"):
        engine.generate([], GenerationConfig())
    with pytest.raises(PromptError, match="empty"):
        engine.prefill([[1, 2], []])


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError):
        GenerationConfig(max_new_tokens=0)
