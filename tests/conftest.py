"""Tiny random models built from configs (no files), one per family, and shared fixtures."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: no test reaches a hub

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers import DeepseekV3Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from kvforge.models.adapters import adapter_for
from kvforge.models.loading import LoadedModel, cast_model, model_fingerprint

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread():
    """Every test starts at one thread: a CLI command run in-process sets torch's threads to every
    core (its default), and some paths (bf16 norms) choose by the thread count."""
    yield
    torch.set_num_threads(1)

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(family: str):
    if family == "llama":
        return LlamaConfig(**COMMON, tie_word_embeddings=True)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=8)
    if family == "qwen2":
        return Qwen2Config(**COMMON, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**COMMON)
    if family == "qwen3_moe":  # experts on layers 1 and 3, a dense MLP on 0 and 2
        return Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                              decoder_sparse_step=2, norm_topk_prob=True)
    if family == "gemma3":
        return Gemma3TextConfig(
            **COMMON,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
    if family == "qwen3_next":  # hybrid: three Gated DeltaNet layers, then full attention; MoE on layers 1, 3
        return Qwen3NextConfig(**COMMON, **HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32, decoder_sparse_step=2, partial_rotary_factor=0.5)
    if family == "qwen3_5":  # hybrid, dense MLPs, one projection per DeltaNet input
        return Qwen3_5TextConfig(**COMMON, **HYBRID)
    if family == "deepseek_v3":  # MLA (latent rank 12, rope 8, no-rope 16, values 12); experts on layers 2, 3
        mla = {k: v for k, v in COMMON.items() if k not in ("head_dim", "num_key_value_heads")}
        return DeepseekV3Config(**mla, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                                n_group=1, topk_group=1, first_k_dense_replace=2, rope_interleave=True)
    raise ValueError(family)


HYBRID = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
ATTENTION_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "deepseek_v3"]
HYBRID_FAMILIES = ["qwen3_next", "qwen3_5"]
FAMILIES = ATTENTION_FAMILIES + HYBRID_FAMILIES


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family)
    for key, value in overrides.items():  # e.g. vocab_size
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    # Random init is near-uniform; sharpen the weights so logits and argmaxes are distinct.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
        # transformers initialises a DeltaNet layer's decay rate A in (0, 16): a state then keeps
        # ~1e-5 of itself per token and forgets everything but the last few rows, so a wrong state
        # (a bad rollback, a missed row) would go unseen. A in (0.01, 0.1) keeps ~90-99 % per token.
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.empty_like(layer.linear_attn.A_log).uniform_(0.01, 0.1).log())
    return model.eval()


def char_tokenizer():
    """A tiny byte-level tokenizer (ids 3..96) built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i, ch in enumerate(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()\n"):
        if len(vocab) < COMMON["vocab_size"]:
            vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def held(layer) -> tuple[torch.Tensor, ...]:
    """What a cached layer keeps of its rows: keys and values, or a recurrent layer's conv and state."""
    from kvforge.cache import RecurrentLayerCache

    return (layer.conv, layer.state) if isinstance(layer, RecurrentLayerCache) else (layer.keys(), layer.values())


def tiny_loaded(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> LoadedModel:
    """A tiny model ready for the engine; in a lower `dtype` it is the fp32 weights cast (as
    `load_model` casts them), before the adapter fuses its projections, with the fp32 fingerprint.
    `overrides`: config fields set on the family's tiny config."""
    model = tiny_hf_model(family, seed, **overrides)
    fingerprint = model_fingerprint(model) if dtype != torch.float32 else None
    cast_model(model, dtype)
    loaded = LoadedModel(f"tiny-{family}", "test", model, char_tokenizer(), adapter_for(model), torch.device("cpu"), dtype)
    if fingerprint is not None:
        vars(loaded)["fingerprint"] = fingerprint
    return loaded


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny llama saved as a Hugging Face directory (weights + tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_hf_model("llama")
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path



@pytest.fixture(scope="session")
def real_model():
    """The packaged smollm2-135m (slow tests only)."""
    from kvforge.models import load_model

    return load_model("smollm2-135m", dtype="fp32")
