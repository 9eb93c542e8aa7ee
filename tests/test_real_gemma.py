"""Slow test on the packaged gemma3-270m: sliding-window layers on real text past the window."""

import pytest
import torch

from kvforge.data.prompts import held_out_text_tokens
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig

pytestmark = pytest.mark.slow


def test_gemma3_matches_transformers_past_the_sliding_window():
    from kvforge.models import load_model

    engine = Engine(load_model("gemma3-270m", dtype="fp32"))
    # Gemma is trained with <bos> first; a conversion that loses the GGUF's add-BOS flag (transformers
    # 5.19) still matches transformers below, on equally wrong ids, so check the tokenizer itself.
    tokenizer = engine.model.tokenizer
    assert tokenizer("hello").input_ids[0] == tokenizer.bos_token_id
    window = engine.model.config.sliding_window
    ids = held_out_text_tokens(engine.model.tokenizer, window + 200)
    x = torch.tensor([ids])
    logits, _ = engine.prefill(x, logits="all")
    with torch.inference_mode():
        ref = engine.model.hf(x).logits
        ref_tokens = engine.model.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False)
    assert (logits - ref).abs().max() < 1e-3
    ours = engine.generate(ids, GenerationConfig(max_new_tokens=16))[0]
    assert ours.token_ids == ref_tokens[0, len(ids) :].tolist()
