"""generate(): max tokens, EOS, stop strings, streaming, seeds, context and prompt checks."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

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


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_samples_of_one_prompt_prefill_it_once_and_decode_as_it_would_alone(family, monkeypatch):
    """An RL group or `n` completions: copies of one prompt are prefilled once and their rows copied
    (`LayerCache.shared`), and the batch's attention reads those rows once. Each sample's logits,
    at a decode step and at a verification-width step, equal the prompt's own alone to the bit (bf16:
    the compiled kernels round a row alike at any batch)."""
    from unittest import mock

    from kvforge import attention
    from kvforge.ops import kernels

    if not kernels.available(16):
        pytest.skip("no AVX512-BF16 or no C compiler here")
    monkeypatch.setattr(attention, "SHARED_MIN_READS", 64)  # a tiny model's short prompt takes the path too,
    monkeypatch.setattr(attention, "SHARED_MAX_QUERIES", 4)  # and its 4-token step
    engine = Engine(tiny_loaded(family, dtype=torch.bfloat16))
    prompt = torch.randint(3, 90, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    with mock.patch.object(engine, "pad_batch", wraps=engine.pad_batch) as padded:
        logits, cache = engine.prefill([prompt] * 3)
    assert padded.call_args.args[0] == [prompt]  # one prompt prefilled, not three
    assert all(layer.shared == len(prompt) for layer in cache.layers)
    alone_logits, _ = engine.prefill([prompt])
    assert torch.equal(logits, alone_logits.expand(3, -1))
    steps = [torch.tensor([[5], [6], [7]]), torch.tensor([[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]])]
    with torch.inference_mode(), mock.patch.object(attention, "_shared_prefix", wraps=attention._shared_prefix) as once:
        together, start, calls = [], len(prompt), []
        for ids in steps:
            positions = torch.arange(start, start + ids.shape[1]).expand(3, -1)
            together.append(engine.forward(ids, positions, cache, "all"))
            start += ids.shape[1]
            calls.append(once.call_count - sum(calls))
        for b in range(3):
            _, own = engine.prefill([prompt])
            start = len(prompt)
            for ids, batch_logits in zip(steps, together):
                positions = torch.arange(start, start + ids.shape[1]).view(1, -1)
                assert torch.equal(engine.forward(ids[b : b + 1], positions, own, "all")[0], batch_logits[b])
                start += ids.shape[1]
    assert calls[0] > 0 and calls[1] == calls[0]  # both steps, the same layers (a sliding-window layer reads its window)


@pytest.mark.parametrize("prompt_len", [40, 100])  # below and above the 64 shared rows `_shared_prefix` needs
def test_sequences_of_different_lengths_attend_to_their_own_ends_with_the_bits_of_each_alone(prompt_len, monkeypatch):
    """After a step that leaves a group's samples at different lengths (a drafted step rolled back
    by what each accepted), the batch's next steps read each sequence to its own end, no mask, in
    one kernel call per layer (a short prompt) or reading the prompt's shared rows once (a long
    one), and each sample's logits equal its own alone to the bit."""
    from unittest import mock

    from kvforge import attention
    from kvforge.ops import kernels

    if not kernels.available(16):
        pytest.skip("no AVX512-BF16 or no C compiler here")
    monkeypatch.setattr(attention, "SHARED_MIN_READS", 64)  # a tiny model's short prompt takes the path too
    engine = Engine(tiny_loaded("llama", dtype=torch.bfloat16))
    p = prompt_len
    prompt = torch.randint(3, 90, (p,), generator=torch.Generator().manual_seed(3)).tolist()
    draft = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    keep = [3, 1, 2]  # rows each sample keeps of the three
    with torch.inference_mode():
        _, cache = engine.prefill([prompt] * 3)
        engine.forward(draft, torch.arange(p, p + 3).expand(3, -1), cache, "all")
        cache.rollback([3 - n for n in keep])
        assert all(layer.aligned and layer.ends == [p + n for n in keep] for layer in cache.layers)
        ids = torch.tensor([[20], [21], [22]])
        positions = torch.tensor([[p + n] for n in keep])
        with (mock.patch.object(kernels, "few_query_attention", wraps=kernels.few_query_attention) as kernel,
              mock.patch.object(attention, "_shared_prefix", wraps=attention._shared_prefix) as once):
            together = engine.forward(ids, positions, cache, "all")
        calls = once.call_args_list if p >= 64 else kernel.call_args_list
        assert (once.call_count, kernel.call_count) == ((engine.num_layers, 0) if calls is once.call_args_list else (0, engine.num_layers))
        ends = [call.args[-1] for call in calls] if calls is once.call_args_list else [call.kwargs["lengths"] for call in calls]
        assert ends == [[p + 1 + n for n in keep]] * engine.num_layers
        for b, n in enumerate(keep):  # the same steps for the sample alone
            _, own = engine.prefill([prompt])
            engine.forward(draft[b : b + 1], torch.arange(p, p + 3).view(1, -1), own, "all")
            own.rollback([3 - n])
            assert torch.equal(engine.forward(ids[b : b + 1], positions[b : b + 1], own, "all")[0], together[b])


@pytest.fixture(scope="module")
def real_tokenizers():
    """The packaged models' tokenizers (byte-level BPE and SentencePiece), where they are installed."""
    from transformers import AutoTokenizer

    from kvforge.models.loading import hf_directory

    found = []
    for spec in ("smollm2-135m", "gemma3-270m"):
        try:
            found.append(AutoTokenizer.from_pretrained(str(hf_directory(spec))))
        except Exception:  # a model package that is not installed: its tokenizer is not tested
            continue
    return found


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_incremental_text_is_the_whole_output_decoded_at_every_token(real_tokenizers, data):
    """`detokenize` decodes a window of the last tokens per token, yet its text is the whole output
    decoded at once after every token (multi-byte characters split across tokens included), and the
    window it decodes does not grow with the output."""
    from kvforge.generation import SequenceState, detokenize

    from conftest import char_tokenizer

    tokenizers = [char_tokenizer(), *real_tokenizers]
    tokenizer = data.draw(st.sampled_from(tokenizers))
    pieces = ["a", "b", " ", "c", ".", ",", "'", "\n", "  ", "é", "€", "✓", "日本", "🙂"]
    text = "".join(data.draw(st.lists(st.sampled_from(pieces), min_size=1, max_size=40)))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    decoded = []
    original = tokenizer.decode
    seq = SequenceState(0, 0)
    try:
        tokenizer.decode = lambda tokens, **kw: decoded.append(len(tokens)) or original(tokens, **kw)
        for token in ids:
            seq.token_ids.append(token)
            detokenize(seq, tokenizer)
            assert seq.text == original(seq.token_ids, skip_special_tokens=True)
    finally:
        tokenizer.decode = original
    assert max(decoded, default=0) <= 8  # an emoji is at most 4 byte tokens, beside the window before it
