"""DeepSeek-V3 multi-head latent attention (MLA): the cache holds a compressed latent and one
shared rope key per token, not per-head K/V.

Shapes: B batch, T tokens, E hidden size, H heads, R latent rank (`kv_lora_rank`), P rope dims
(`qk_rope_head_dim`), N no-rope dims (`qk_nope_head_dim`), Dv value dims.

A layer projects h to a query (N + P per head) and to [latent (R), rope key (P)]; the latent is
RMS-normed, the rope key rotated. kvforge caches them as a one-head layer whose "keys" are the
rotated rope keys (B, 1, T, P) and whose "values" are the normed latents (B, 1, T, R), which is
what an MLA cache holds (and what KV-Lingo translates into). Attention expands the cached rows to
per-head keys [kv_b(latent)_nope, rope key] and values kv_b(latent)_v (`attention_view`), as
transformers' own MLA does on every forward. Rope dims are interleaved pairs in the weights
(`rope_interleave`); they are turned into the half-split layout before the usual rotation, which
is what transformers' interleaved rotation computes.
"""

from __future__ import annotations

import torch

from kvforge.cache import LayerCache
from kvforge.models.base import LlamaAdapter
from kvforge.ops.linear import fuse_linears, linear
from kvforge.ops.released import readable
from kvforge.ops.norms import rms_norm
from kvforge.ops.rope import apply_rope


class DeepseekV3Adapter(LlamaAdapter):
    family = "deepseek_v3"

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        c = self.config
        self.num_heads = c.num_attention_heads
        self.kv_heads = 1  # one latent and one rope key per token
        self.rank, self.rope_dim, self.nope_dim, self.v_dim = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
        self.head_dim = self.rope_dim  # the cached key's width
        self.interleaved = bool(getattr(c, "rope_interleave", True))

    def _fuse_attention(self, attn):
        """The two projections that read the normed input: the query (or its low-rank down
        projection) and the latent + rope key."""
        first = attn.q_proj if attn.q_proj is not None else attn.q_a_proj
        return fuse_linears([first, attn.kv_a_proj_with_mqa])

    def cache_dims(self, layer: int) -> tuple[int, int, int]:
        return 1, self.rope_dim, self.rank

    # --- pieces ----------------------------------------------------------------------------
    def _split(self, layer: int, h: torch.Tensor):
        attn = self.layers[layer].self_attn
        x = rms_norm(self.layers[layer].input_layernorm, h)
        weight, bias = self.qkv[layer]
        out = linear(x, weight, bias)
        q_part, latent, rope_key = out.split([out.shape[-1] - self.rank - self.rope_dim, self.rank, self.rope_dim], dim=-1)
        return attn, q_part, rms_norm(attn.kv_a_layernorm, latent), rope_key

    def attention_inputs(self, layer, h, rope):
        attn, q_part, latent, rope_key = self._split(layer, h)
        if attn.q_proj is None:  # low-rank query: norm, then up projection
            q_part = linear(rms_norm(attn.q_a_layernorm, q_part), attn.q_b_proj.weight)
        b, t, _ = h.shape
        q = q_part.view(b, t, self.num_heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        cos, sin = rope[None]
        q = torch.cat([q_nope, apply_rope(self._half_split(q_rope), cos, sin)], dim=-1)
        k, v = self._rows(latent, rope_key, rope)
        return q, k, v, None

    def kv_weights(self, layer):
        weight, bias = self.qkv[layer]
        start = weight.shape[0] - self.rank - self.rope_dim  # the latent and the rope key, after the query rows
        return readable(weight, start), None if bias is None else bias[start:]

    def cache_rows(self, layer, projected, rope):
        latent, rope_key = projected.split([self.rank, self.rope_dim], dim=-1)
        return self._rows(rms_norm(self.layers[layer].self_attn.kv_a_layernorm, latent), rope_key, rope)

    def _rows(self, latent: torch.Tensor, rope_key: torch.Tensor, rope: dict):
        """Cache rows: rotated rope keys (B, 1, T, P) and normed latents (B, 1, T, R)."""
        cos, sin = rope[None]
        k = apply_rope(self._half_split(rope_key.unsqueeze(1)), cos, sin)
        return k, latent.unsqueeze(1)

    def _half_split(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if self.interleaved else x

    def attention_view(self, layer: int, cached: LayerCache) -> LayerCache:
        """The layer's rows expanded to per-head keys (B, H, T, N + P) and values (B, H, T, Dv)."""
        attn = self.layers[layer].self_attn
        latent, rope_key = cached.values(), cached.keys()
        b, _, t, _ = latent.shape
        kv = linear(latent.squeeze(1), attn.kv_b_proj.weight).view(b, t, self.num_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, rope_key.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return LayerCache(k, v.contiguous(), cached.row_positions(), cached.row_kinds(), length=t, contiguous=cached.contiguous)

    # --- key stages: the rope key has no k-norm -----------------------------------------------
    def key_norm_scale(self, layer):
        return None

    def finish_keys(self, layer, k, rope, point):
        if point in ("pre-norm", "post-norm"):
            cos, sin = rope[None]
            return apply_rope(k, cos, sin)
        return super().finish_keys(layer, k, rope, point)
