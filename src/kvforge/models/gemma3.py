"""Gemma 3: Qwen3's layer with sandwich norms, (1+w) norm weights and per-layer-type RoPE tables."""

from __future__ import annotations

import torch

from kvforge.models.qwen3 import Qwen3Adapter
from kvforge.ops.norms import rms_norm


class Gemma3Adapter(Qwen3Adapter):
    """Gemma 3 = Qwen3 + (1+w) norms and the embedding scale (both inside transformers' modules),
    sandwich norms around attention and MLP, query_pre_attn_scalar scaling (read from the module),
    and sliding-window local layers with their own RoPE table."""

    family = "gemma3"

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        if getattr(self.config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional Gemma 3 (embedding models) is not a causal LM")
        if getattr(self.config, "attn_logit_softcapping", None):
            raise ValueError("attention logit softcapping is not supported")
        self.layer_types = list(self.config.layer_types)

    def rope_key(self, layer: int) -> str:
        return self.layer_types[layer]

    def rope(self, h, positions):
        pos = positions.clamp(min=0)
        return {kind: self.body.rotary_emb(h, pos, kind) for kind in set(self.layer_types)}

    def attention_output(self, layer, h, o, gate=None):
        return h + rms_norm(self.layers[layer].post_attention_layernorm, self._output_projection(layer, o), stream=True)

    def mlp_block(self, layer, h):
        block = self.layers[layer]
        return h + rms_norm(block.post_feedforward_layernorm, self._mlp(layer, rms_norm(block.pre_feedforward_layernorm, h, stream=True)), stream=True)
