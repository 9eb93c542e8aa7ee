"""Qwen3 and Qwen3-MoE: Llama's layer with per-head q/k norms (and, for MoE, routed experts run
by the model's own module)."""

from __future__ import annotations

from kvforge.models.base import LlamaAdapter
from kvforge.ops.norms import rms_norm


class Qwen3Adapter(LlamaAdapter):
    """Qwen3 = Llama + per-head RMSNorm on q and k before RoPE."""

    family = "qwen3"

    def _q_norm(self, attn, q):
        return rms_norm(attn.q_norm, q)

    def _k_norm(self, attn, k):
        return rms_norm(attn.k_norm, k)


class Qwen3MoeAdapter(Qwen3Adapter):
    """Qwen3-MoE = Qwen3 with a sparse mixture-of-experts MLP (top-k routed experts) on the layers
    `decoder_sparse_step` picks; the attention and its cache are Qwen3's, so every cache method
    (RidgeFill, SPEED, KV-Lingo as a target or source) applies unchanged."""

    family = "qwen3_moe"
