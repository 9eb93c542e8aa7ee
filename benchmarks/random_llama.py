"""Write a randomly initialised Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads,
4 KV heads, MLP 5632) with SmolLM2's tokenizer (49,152 tokens), as a Hugging Face directory with
bf16 safetensors, as checkpoints of this size ship. It measures kvforge at a real model size:
loading's memory and time, prefill and decode speed, and (with random RidgeFill maps) RidgeFill's
TTFT. Random weights: speed only; its outputs are noise and no quality figure means anything on it.

    python benchmarks/random_llama.py ~/.cache/kvforge/models/llama-1b-random
    kvforge bench load --model ~/.cache/kvforge/models/llama-1b-random --dtypes bf16,fp32 --json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tiny_hybrid import write_random  # the same writer: random weights, SmolLM2's tokenizer
from transformers import LlamaConfig


def config(vocab_size: int, bos: int, eos: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=bos, eos_token_id=eos,
    )


def main(out: Path) -> None:
    model = write_random(config, out, torch.bfloat16)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, bf16")


if __name__ == "__main__":
    main(Path(sys.argv[1]).expanduser())
