"""Family adapters: one decoder layer exposed as pieces, so the engine's loop can run any layer
on any rows.

Shapes: B batch, T tokens, E hidden size, Hq query heads, H KV heads, D head dim.

A layer is: `attention_inputs` (input norm, q/k/v projections, qk-norm, RoPE) -> the engine
appends k, v to the cache and attends -> `attention_output` (o_proj, residual) -> `mlp_block`
(norm, MLP, residual). Weights stay in transformers' modules; the loop is ours. Llama is the
base (this module); every other family is its difference from Llama, in a module of its own
(`kvforge.models.adapters.FAMILIES` names them by `model_type`).
"""

from __future__ import annotations

import torch

from kvforge.ops import kernels
from kvforge.ops.linear import fuse_linears, linear
from kvforge.ops.released import is_released, packed_rows, readable
from kvforge.ops.norms import rms_norm, rms_norm_params
from kvforge.ops.rope import apply_rope

_SILU = ("SiLUActivation", "SiLU")  # transformers' and torch's silu modules: `kernels.silu_mul` computes them


def _looks_rows_up(table: torch.nn.Module) -> bool:
    """Whether an embedding module's forward is its rows, times Gemma's `embed_scale` at most
    (what `embed` computes from a released table's packed pairs)."""
    known = type(table) is torch.nn.Embedding or type(table).__name__ == "Gemma3TextScaledWordEmbedding"
    return known and table.max_norm is None


class LlamaAdapter:
    """Llama, SmolLM2, Mistral and Qwen2 (q/k/v biases live in the modules themselves)."""

    family = "llama"

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = model.config
        self.body = model.model
        self.layers = self.body.layers
        c = self.config
        self.num_layers = c.num_hidden_layers
        self.num_heads = c.num_attention_heads
        self.kv_heads = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.hidden_size = c.hidden_size
        # None on a layer without softmax attention (a hybrid's linear-attention layers)
        attns = [getattr(layer, "self_attn", None) for layer in self.layers]
        self.scaling = [None if a is None else a.scaling for a in attns]
        self.windows = [self._window(i) for i in range(self.num_layers)]
        self.qkv = [None if a is None else self._fuse_attention(a) for a in attns]
        # None for a layer whose MLP is not one gated MLP (a mixture of experts): it runs as its module
        self.gate_up = [fuse_linears([l.mlp.gate_proj, l.mlp.up_proj]) if hasattr(l.mlp, "gate_proj") else None for l in self.layers]
        # the module's own tensors (no copy), held here beside the fused ones so an adapter can swap
        # every projection of a layer (full fine-tuning: kvforge.fill.lora)
        self.o = [None if a is None else (a.o_proj.weight, a.o_proj.bias) for a in attns]
        self.down = [None if g is None else (l.mlp.down_proj.weight, l.mlp.down_proj.bias) for g, l in zip(self.gate_up, self.layers)]

    def projection_weights(self) -> list[torch.Tensor]:
        """The weights the engine reads through `linear` alone: every layer's fused q/k/v and
        gate/up, its o and down projections, and the LM head (an embedding table tied to it is
        read through `embed`, which can look rows up in the packed pairs)."""
        pairs = [p for each in (self.qkv, self.gate_up, self.o, self.down) for p in each if p is not None]
        head, table = self.model.lm_head.weight, self.model.get_input_embeddings()
        tied = head.untyped_storage().data_ptr() == table.weight.untyped_storage().data_ptr()
        return [weight for weight, _ in pairs] + ([head] if not tied or _looks_rows_up(table) else [])

    def _fuse_attention(self, attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projections that read the layer's normed input, fused into one matmul."""
        return fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])

    # --- per-layer facts -------------------------------------------------------------------
    def cache_dims(self, layer: int) -> tuple[int, int, int]:
        """An attention layer's cached rows: heads, key width, value width."""
        return self.kv_heads, self.head_dim, self.head_dim

    def attention_view(self, layer: int, cached):
        """The rows attention reads: the cached ones themselves (MLA expands its latents here)."""
        return cached

    def _window(self, layer: int) -> int | None:
        """Sliding-window size of `layer` (keys with q_pos - k_pos >= window are hidden)."""
        types = getattr(self.config, "layer_types", None)
        if types is not None:
            return self.config.sliding_window if types[layer] == "sliding_attention" else None
        return getattr(self.config, "sliding_window", None)  # Mistral: every layer

    def is_recurrent(self, layer: int) -> bool:
        """Whether a layer mixes tokens through a recurrent state instead of attention (hybrids)."""
        return False

    def rope_key(self, layer: int) -> str | None:
        """Which rotary table a layer uses (families with per-layer-type RoPE override this)."""
        return None

    # --- pieces ----------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> h (B, T, E); family embedding scales live in the module. A table released
        to its packed pairs (tied to the LM head: `Engine.release_unpacked_weights`) hands the
        module just the rows these ids look up."""
        table = self.body.embed_tokens
        if not is_released(table.weight):
            return table(ids)
        h = packed_rows(table.weight, ids.reshape(-1)).view(*ids.shape, -1)
        scale = getattr(table, "embed_scale", None)  # Gemma's scaled embedding: its forward's own product
        return h if scale is None else h * scale.to(h.dtype)

    def rope(self, h: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin (B, T, D) for every rotary table, at `positions` (B, T; padding -1 -> 0)."""
        pos = positions.clamp(min=0)
        return {None: self.body.rotary_emb(h, pos)}

    def attention_inputs(self, layer: int, h: torch.Tensor, rope: dict) -> tuple[torch.Tensor, ...]:
        """h (B, T, E) -> q (B, Hq, T, D), k and v (B, H, T, D), and the output gate `attention_output`
        takes (None here; a gated family's (B, Hq, T, D)); k after k-norm and RoPE."""
        q, k, v = self._project(layer, h).split([self.num_heads, self.kv_heads, self.kv_heads], dim=1)
        cos, sin = rope[self.rope_key(layer)]
        q = apply_rope(self._q_norm(self.layers[layer].self_attn, q), cos, sin)
        return q, self._rotate_key(layer, k, rope), v, None

    def key_value(self, layer: int, h: torch.Tensor, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the cache rows a layer writes from input h (B, T, E): k, v (B, H, T, D), no query."""
        weight, bias = self.kv_weights(layer)
        return self.cache_rows(layer, linear(rms_norm(self.layers[layer].input_layernorm, h, stream=True), weight, bias), rope)

    # --- the cache rows as a linear function of the normed input (RidgeFill folds its maps into it)
    def kv_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W (C, E), b (C,) or None): the rows of the layer's input projection the cache is made
        from, read from the normed input (a slice is a view: `linear` packs only whole weights, so
        the full projection keeps its packed copy)."""
        weight, bias = self.qkv[layer]
        start = self._kv_start()
        return readable(weight, start), None if bias is None else bias[start:]

    def _kv_start(self) -> int:
        return self.num_heads * self.head_dim

    def cache_rows(self, layer: int, projected: torch.Tensor, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_weights`' output (B, T, C) -> the cache rows k, v (B, H, T, D): k-norm and RoPE applied."""
        b, t, _ = projected.shape
        k, v = projected.view(b, t, -1, self.head_dim).transpose(1, 2).split([self.kv_heads, self.kv_heads], dim=1)
        return self._rotate_key(layer, k, rope), v

    def input_norm(self, layer: int) -> tuple[torch.Tensor, float] | None:
        """The layer's input RMSNorm as (gain (E,) fp32, eps): norm(h) = gain * h / sqrt(mean(h²) + eps);
        None for a norm kvforge does not know."""
        norm = self.layers[layer].input_layernorm
        params = rms_norm_params(norm)
        if params is None:
            return None
        eps, one_plus = params
        weight = norm.weight.detach().float()
        return (1.0 + weight if one_plus else weight), eps

    def _project(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Input norm, then the fused q/k/v projection: (B, heads, T, D)."""
        x = rms_norm(self.layers[layer].input_layernorm, h, stream=True)
        b, t, _ = x.shape
        out = linear(x, *self.qkv[layer])
        return out.view(b, t, -1, self.head_dim).transpose(1, 2)

    def _rotate_key(self, layer: int, k: torch.Tensor, rope: dict) -> torch.Tensor:
        cos, sin = rope[self.rope_key(layer)]
        return apply_rope(self._k_norm(self.layers[layer].self_attn, k), cos, sin)

    # --- key stages (KV-Lingo reads and writes keys before RoPE and before the k-norm) -------
    def unrotate_keys(self, layer: int, k: torch.Tensor, rope: dict) -> torch.Tensor:
        """Cached keys (B, H, T, D) rotated back to position 0: the key after k-norm, before RoPE."""
        cos, sin = rope[self.rope_key(layer)]
        return apply_rope(k, cos, -sin)

    def key_norm_scale(self, layer: int) -> torch.Tensor | None:
        """(D,) the k-norm's per-dimension multiplier, or None for a family without k-norm.
        Read off the module by normalising a vector of ones (RMS 1), so no family's weight
        convention (w or 1 + w) is written here."""
        attn = self.layers[layer].self_attn
        ones = torch.ones(1, 1, 1, self.head_dim, dtype=self.qkv[layer][0].dtype, device=self.qkv[layer][0].device)
        with torch.no_grad():
            scaled = self._k_norm(attn, ones)
        return None if scaled is ones else scaled.view(-1)

    def finish_keys(self, layer: int, k: torch.Tensor, rope: dict, point: str) -> torch.Tensor:
        """Keys (B, H, T, D) given at capture `point` made ready for the cache: pre-norm keys are
        normalised and rotated, post-norm keys rotated, post-rope keys kept."""
        if point == "pre-norm":
            return self._rotate_key(layer, k, rope)
        if point == "post-norm":
            cos, sin = rope[self.rope_key(layer)]
            return apply_rope(k, cos, sin)
        if point == "post-rope":
            return k
        raise ValueError(f"unknown capture point {point!r}: use pre-norm, post-norm or post-rope")

    def _q_norm(self, attn: torch.nn.Module, q: torch.Tensor) -> torch.Tensor:
        return q

    def _k_norm(self, attn: torch.nn.Module, k: torch.Tensor) -> torch.Tensor:
        return k

    def attention_output(self, layer: int, h: torch.Tensor, o: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Residual update from attention output o (B, Hq, T, D) and the gate `attention_inputs` gave."""
        return h + self._output_projection(layer, o)

    def _output_projection(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        weight, bias = self.o[layer]
        return linear(o.transpose(1, 2).reshape(b, t, -1), weight, bias)

    def mlp_block(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        return h + self._mlp(layer, rms_norm(block.post_attention_layernorm, h, stream=True))

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP with gate and up projections as one matmul; any other MLP (a sparse mixture
        of experts: router, top-k experts) through its own module, whose routing is the model's."""
        mlp = self.layers[layer].mlp
        if self.gate_up[layer] is None:
            out = mlp(x)
            return out[0] if isinstance(out, tuple) else out  # some MoE blocks also return router logits
        weight, bias = self.gate_up[layer]
        gate_up = linear(x, weight, bias)
        down, down_bias = self.down[layer]
        if type(mlp.act_fn).__name__ in _SILU and kernels.silu_mul_fits(gate_up):  # bf16: one pass, every step alike
            return linear(kernels.silu_mul(gate_up), down, down_bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(mlp.act_fn(gate) * up, down, down_bias)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h (B, T, E) -> logits (B, T, V)."""
        head = self.model.lm_head
        logits = linear(rms_norm(self.body.norm, h, stream=True), head.weight, head.bias)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


ModelAdapter = LlamaAdapter
