"""Hybrid families: Qwen3-Next and Qwen3.5 text models, three Gated DeltaNet (linear-attention)
layers to one full-attention layer.

Shapes: B batch, T tokens, E hidden size, Hq query heads, D head dim.

Their full-attention layers are Qwen3's with three differences: (1+w) RMSNorms, partial RoPE
(only the first `partial_rotary_factor` of each head turns; `apply_rope` handles it), and an
output gate -- q_proj yields a query and a gate per head, and sigmoid(gate) scales the attention
output before o_proj. Their linear-attention layers keep a state, not K/V rows: the engine holds
it in a `RecurrentLayerCache` and runs the layer through `mix` / `mix_output` (`deltanet`).
"""

from __future__ import annotations

import torch

from kvforge.models import deltanet
from kvforge.models.qwen3 import Qwen3Adapter
from kvforge.ops.linear import linear
from kvforge.ops.norms import rms_norm
from kvforge.ops.rope import apply_rope


class Qwen3NextAdapter(Qwen3Adapter):
    """Qwen3-Next (sparse MoE MLPs on most layers, run through their modules) and Qwen3.5 text
    (dense MLPs; one projection per q/k/v, z, b, a in its DeltaNet layers)."""

    family = "qwen3_next"

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.layer_types = list(self.config.layer_types)
        unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"unknown hybrid layer types {sorted(unknown)}")

    # --- per-layer facts -------------------------------------------------------------------
    def is_recurrent(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def _window(self, layer: int) -> int | None:
        return None

    def state_spec(self, layer: int) -> tuple[int, int, tuple[int, int, int]]:
        """A linear-attention layer's state: conv channels, conv history (K-1), recurrent (Hv, Dk, Dv)."""
        m = self.layers[layer].linear_attn
        return m.conv_dim, m.conv_kernel_size - 1, (m.num_v_heads, m.head_k_dim, m.head_v_dim)

    # --- full attention: the gated query --------------------------------------------------------
    def attention_inputs(self, layer, h, rope):
        # q_proj's rows are [query, gate] per head, so the fused projection's first 2 Hq "heads" of
        # width D alternate query, gate, query, gate, ...
        qg, k, v = self._project(layer, h).split([2 * self.num_heads, self.kv_heads, self.kv_heads], dim=1)
        cos, sin = rope[self.rope_key(layer)]
        q = apply_rope(self._q_norm(self.layers[layer].self_attn, qg[:, 0::2]), cos, sin)
        return q, self._rotate_key(layer, k, rope), v, qg[:, 1::2]

    def _kv_start(self):
        return 2 * self.num_heads * self.head_dim  # after the interleaved query and gate rows

    def attention_output(self, layer, h, o, gate=None):
        return h + self._output_projection(layer, o * torch.sigmoid(gate))

    # --- linear attention ------------------------------------------------------------------------
    def mix(self, layer: int, h: torch.Tensor, conv: torch.Tensor, state: torch.Tensor, padding: torch.Tensor | None, per_token: bool):
        """Rows h (B, T, E) in position order through the layer's input norm, projections, conv and
        recurrence from `conv` (B, C, K-1) and `state` (B, Hv, Dk, Dv). Returns (core, z) for
        `mix_output`, the conv window (B, C, K-1+T) and the states after the rows (after each one
        when `per_token`). Padding rows (bool (B, T)) enter as zeros (transformers masks them so)
        and leave the state as it was, also a state with history (`deltanet.recur`, `conv_window`)."""
        m = self.layers[layer].linear_attn
        x = rms_norm(self.layers[layer].input_layernorm, h)
        if padding is not None:
            x = x.masked_fill(padding.unsqueeze(-1), 0)
        mixed, z, b, a = deltanet.project(m, x, linear)
        window = deltanet.conv_window(conv, mixed, padding)
        core, states = deltanet.recur(m, deltanet.convolve(m, window, mixed.dtype), b, a, state, per_token, padding)
        return (core, z), window, states

    def mix_output(self, layer: int, h: torch.Tensor, mixed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Residual update from `mix`'s (core, z) of the same rows."""
        core, z = mixed
        return h + deltanet.gated_output(self.layers[layer].linear_attn, core, z, linear)

