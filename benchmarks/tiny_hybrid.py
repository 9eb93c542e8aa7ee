"""Write a randomly initialised hybrid (Qwen3.5 text: three Gated DeltaNet layers to one
full-attention layer) of SmolLM2-135M's width (32 layers: 8 of them full attention), with SmolLM2's tokenizer, as a Hugging
Face directory. No hybrid with real weights is among the packaged models, so this model measures
speed only: its outputs are noise and no quality figure means anything on it.

    python benchmarks/tiny_hybrid.py ~/.cache/kvforge/models/hybrid-qwen3_5-random
    kvforge fit ridgefill --model ~/.cache/kvforge/models/hybrid-qwen3_5-random --split fast --calib-tokens 24576 --threads 1
    kvforge bench ridgefill --model ~/.cache/kvforge/models/hybrid-qwen3_5-random --tokens 1024,4096 --threads 1 --json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from kvforge.models.loading import _resolve

LAYERS = 32  # 24 Gated DeltaNet + 8 full attention


def config(vocab_size: int, bos: int, eos: int) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=576, intermediate_size=1536, num_hidden_layers=LAYERS,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * (LAYERS // 4),
        tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos,
    )


def write_random(make_config, out: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A model of `make_config(vocab_size, bos, eos)` with random weights (seed 0) and SmolLM2's
    tokenizer, saved in `dtype` as a Hugging Face directory at `out`."""
    tokenizer = AutoTokenizer.from_pretrained(str(_resolve("smollm2-135m")[0]))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id), dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model


def main(out: Path) -> None:
    model = write_random(config, out, torch.float32)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {LAYERS} layers")


if __name__ == "__main__":
    main(Path(sys.argv[1]).expanduser())
