"""Family adapters: one decoder layer exposed as pieces, so the engine's loop can run any layer
on any rows.

Shapes: B batch, T tokens, E hidden size, Hq query heads, H KV heads, D head dim.

A layer is: `attention_inputs` (input norm, q/k/v projections, qk-norm, RoPE) -> the engine
appends k, v to the cache and attends -> `attention_output` (o_proj, residual) -> `mlp_block`
(norm, MLP, residual). Weights stay in transformers' modules; the loop is ours. Llama is the
base; every other family is its difference from Llama.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvforge import kernels


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
        """ids (B, T) -> h (B, T, E); family embedding scales live in the module."""
        return self.body.embed_tokens(ids)

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
        return weight[start:], None if bias is None else bias[start:]

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
        gate, up = linear(x, weight, bias).chunk(2, dim=-1)
        down, down_bias = self.down[layer]
        return linear(mlp.act_fn(gate) * up, down, down_bias)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h (B, T, E) -> logits (B, T, V)."""
        head = self.model.lm_head
        logits = linear(rms_norm(self.body.norm, h, stream=True), head.weight, head.bias)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


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


ModelAdapter = LlamaAdapter

_FAMILIES: dict[str, type[LlamaAdapter]] = {
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "qwen3": Qwen3Adapter,
    "qwen3_moe": Qwen3MoeAdapter,
    "gemma3_text": Gemma3Adapter,
}

# linear-attention hybrids (kvforge.models.hybrid) and latent attention (kvforge.models.mla):
# subclasses of this module's adapters, imported when asked for
_HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_text")
_MLA_FAMILIES = ("deepseek_v3",)


def adapter_for(model: torch.nn.Module) -> LlamaAdapter:
    """The family adapter for a transformers causal LM."""
    model_type = model.config.model_type
    if model_type in _HYBRID_FAMILIES:
        from kvforge.models.hybrid import Qwen3NextAdapter

        return Qwen3NextAdapter(model)
    if model_type in _MLA_FAMILIES:
        from kvforge.models.mla import DeepseekV3Adapter

        return DeepseekV3Adapter(model)
    if model_type not in _FAMILIES:
        from kvforge.errors import UnknownModelError

        raise UnknownModelError(
            f"model family {model_type!r} is not supported (supported: {', '.join(sorted([*_FAMILIES, *_HYBRID_FAMILIES, *_MLA_FAMILIES]))})"
        )
    return _FAMILIES[model_type](model)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by cos, sin (B, T, R) in the half-split (GPT-NeoX) layout; with partial
    RoPE (R < D) only the first R dimensions turn."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_ONE_PLUS_W_NORMS = ("Gemma3RMSNorm", "Qwen3NextRMSNorm", "Qwen3_5RMSNorm")


def rms_norm_params(norm: torch.nn.Module) -> tuple[float, bool] | None:
    """(eps, one_plus) of an RMSNorm kvforge knows (Llama's `w * x`, or Gemma's `x * (1 + w)`), else None."""
    if hasattr(norm, "variance_epsilon"):  # Llama, Mistral, Qwen2, Qwen3
        return norm.variance_epsilon, False
    if type(norm).__name__ in _ONE_PLUS_W_NORMS:
        return norm.eps, True
    return None


def rms_norm(norm: torch.nn.Module, x: torch.Tensor, stream: bool = False) -> torch.Tensor:
    """A family's RMSNorm module applied with torch's fused `F.rms_norm`: the same arithmetic as
    the module's forward (normalise in fp32, then Llama's `w * x.to(dtype)` or Gemma's
    `(x * (1 + w)).to(dtype)`), bit for bit on the parity tests, in 2-4 ops instead of 8. A decode
    step is short enough that the per-op cost of ~200 small ops per layer is a fifth of it.

    `stream`: x is a (B, T, E) row block of the residual stream (or a branch's output added to it);
    in bf16 with the compiled kernels, a step of up to `kernels.SMALL_ROWS` tokens per sequence
    (decode, verification: the steps `linear` sends to `small_linear`) normalises it in one call
    (`kernels.rms_norm`, the same formula, its sum of squares in another order: a decode step's 61
    norms ~1.2 ms -> ~0.1 ms); a longer step (a prefill) too when torch runs one thread (a 4K-token
    bf16 prefill's 61 norms: 166 ms in torch's ops, which go through fp32 copies), else torch's ops,
    which use every thread. The choice depends on T and the thread count, never on layout (a slice
    such as the last row the head reads is made contiguous: a few rows), so a decode step and a
    verification round alike. Heads' q/k norms and other
    families' norms keep torch's ops (not measured: a q/k view would need a copy first)."""
    params = rms_norm_params(norm)
    if params is None:
        return norm(x)  # any other norm: its own forward
    eps, one_plus = params
    if (stream and x.dtype == torch.bfloat16 and x.dim() == 3
            and (x.shape[-2] <= kernels.SMALL_ROWS or torch.get_num_threads() == 1)):
        x = x.contiguous()
        if kernels.rms_norm_fits(x, norm.weight):
            return kernels.rms_norm(x, norm.weight, eps, one_plus)
    normed = F.rms_norm(x.float(), x.shape[-1:], None, eps)
    if one_plus:
        return (normed * (1.0 + norm.weight.float())).to(x.dtype)
    return norm.weight * normed.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, in low precision on CPU with rows that do not depend on how many rows are
    computed at once, and the weight packed once.

    With the compiled kernels (AVX512-BF16), bf16 steps of up to `kernels.SMALL_ROWS` tokens per
    sequence (decode, verification, at any batch size) run `kernels.small_linear` over the weight
    packed into pairs (a row's bits independent of the row count by construction; a decode
    step's 121 matmuls at one row 24 -> 12.5 ms, at 9 rows 28 -> 25 ms, at 16 rows 35 -> 31 ms,
    interleaved, on AMD EPYC with AVX512-BF16) and longer ones (prefill) F.linear; elsewhere, what follows.

    Prepacked: oneDNN's linear over a weight reordered into its blocked layout at first use
    (`mkldnn._reorder_linear_weight`, what torch.compile's CPU backend packs bf16 linears with) and
    kept beside the weight. Measured on AMD EPYC (AVX512-BF16), one thread, smollm2's bf16 shapes with the
    weights streaming from memory as in decoding: a decode step's 121 matmuls 57 -> 32 ms (1 row),
    65 -> 35 ms (9 rows); equal or faster at every width up to 1024-row prefill chunks, with
    results bit-identical to F.linear's.
    Row stability matters for speculative decoding: a one-token decode step and a (k+1)-token
    verification must round alike, else near-ties flip and drafting stops being token-identical to
    plain decoding. oneDNN's one-row kernels, packed or not, round apart from its multi-row ones
    when a row has more than 1024 inputs (measured: 27-45 of 192 rows differ for 1088..3072 inputs,
    none up to 1024; the 1536 -> 576 down projection is one), while 2..32 rows agree with each
    other. Whether a shape does is measured once per shape (`_one_row_rounds_apart`); such a
    single row is computed as two (a broadcast view, no copy of the weights), the others as one. Without a packable weight (a
    view, autograd) it goes through F.linear. fp32 keeps transformers' kernel but for one case
    (`_linear_fp32`): its parity is against transformers."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if x.dtype == torch.float32:
        return _linear_fp32(x, weight, bias, training)
    rows = x.reshape(-1, x.shape[-1])
    if (not training and x.dtype == torch.bfloat16 and kernels.small_linear_fits(weight)
            and (bias is None or bias.dtype == torch.bfloat16)):
        # By the step's tokens per sequence, not its rows: a batch's verification (16 x 9 rows)
        # must round each row as that sequence's decode step does.
        if (x.shape[-2] if x.dim() >= 3 else rows.shape[0]) > kernels.SMALL_ROWS:
            return F.linear(x, weight, bias)  # a prefill: oneDNN at this CPU's peak, packed or not
            # (prepacked 3 % faster at 1K-4K tokens, not worth a third copy of the weight)
        pairs = _packed(weight, kernels.pack_pairs)
        if pairs is not None:
            return kernels.small_linear(rows, pairs, bias).view(*x.shape[:-1], -1)
    packed = None if training else _packed(weight)
    single = rows.shape[0] == 1 and _one_row_rounds_apart(weight.shape[0], weight.shape[1], weight.dtype, packed is not None)
    if single:  # computed as two rows: see above
        rows = rows.expand(2, -1)
    if packed is not None:
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    else:
        out = F.linear(rows, weight, bias)
    return (out[:1] if single else out).view(*x.shape[:-1], -1)


# fp32 weights above this size (bytes) do not stay in this CPU's caches between decode steps
_STREAMED_BYTES = 16 << 20


def _linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, training: bool) -> torch.Tensor:
    """fp32 keeps transformers' kernel (F.linear: MKL's SGEMM, its SGEMV for one row) at every width
    but one: a single row through a weight too large for the caches (the LM head). There SGEMV
    streams the weight at ~9 GB/s and MKL's packed SGEMM, over a copy packed once, at ~19 GB/s
    (smollm2-135m's 49152 x 576 head, one thread: 13.2 -> 5.9 ms, a tenth of a decode step). That
    row then rounds as an SGEMM row does, ~5e-6 off SGEMV's: as far as transformers' own one-row
    and two-row forwards are apart."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] != 1 or training or weight.numel() * weight.element_size() < _STREAMED_BYTES:
        return F.linear(x, weight, bias)
    packed = _packed(weight, _mkl_pack)
    if packed is None:
        return F.linear(x, weight, bias)
    out = torch.ops.mkl._mkl_linear(rows.contiguous(), packed, weight, bias, 1)
    return out.view(*x.shape[:-1], -1)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1) if _packable(weight.dtype) else None


def _mkl_pack(weight: torch.Tensor) -> torch.Tensor | None:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, 1) if _mkl_packable() else None


_weights_generation = 0  # bumped by `invalidate_packed`: every packed copy made before is stale


def invalidate_packed() -> None:
    """Mark every packed weight copy stale, after weights were written in place (`weights.py`):
    inference tensors keep no version counter, so a packed copy cannot see the write itself."""
    global _weights_generation
    _weights_generation += 1


def _packed(weight: torch.Tensor, pack=_onednn_pack) -> torch.Tensor | None:
    """The weight in a library's packed layout (oneDNN's blocked one by default), made at first use
    and kept on the tensor (remade if the weight changed since: its version counter, storage,
    dtype or an `invalidate_packed`); None for a view (a slice would be packed on every call), a
    non-contiguous weight, or what this CPU's library cannot run."""
    if weight._base is not None or not weight.is_contiguous() or weight.dim() != 2:
        return None
    # inference tensors (made under inference mode, e.g. LoRA-merged weights) keep no version counter
    stamp = (None if weight.is_inference() else weight._version, weight.data_ptr(), weight.dtype, _weights_generation)
    packs = getattr(weight, "_kvforge_packed", None)
    if packs is None:
        packs = weight._kvforge_packed = {}  # one entry per layout: prefill and decode use different ones
    cached = packs.get(pack)
    if cached is None or cached[0] != stamp:
        packed = pack(weight.detach())
        if packed is None:
            return None
        cached = packs[pack] = (stamp, packed)
    return cached[1]


@functools.cache
def _one_row_rounds_apart(out_features: int, in_features: int, dtype: torch.dtype, packed: bool) -> bool:
    """Whether oneDNN computes one row of this shape differently from the same row among others,
    measured once per shape on 64 random rows (on AMD EPYC with AVX512-BF16: only above 1024 inputs, for 14-23 %
    of rows, packed or not; other CPUs and oneDNN releases may differ, hence measured, not assumed)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(dtype)
    x = torch.randn(64, in_features, generator=g).to(dtype)
    if packed:
        p = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        run = lambda rows: torch.ops.mkldnn._linear_pointwise(rows.contiguous(), p, None, "none", [], "")  # noqa: E731
    else:
        run = lambda rows: F.linear(rows, w)  # noqa: E731
    with torch.no_grad():
        return any(not torch.equal(run(x[r : r + 1]), run(x[r : r + 1].expand(2, -1))[:1]) for r in range(64))


@functools.cache
def _mkl_packable() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@functools.cache
def _packable(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def fuse_linears(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (weight, bias) for several linears that read the same input, so a layer does one
    larger matmul instead of several. The modules' own weights are re-pointed at views of the
    fused tensor: memory is not doubled and transformers' forward still works unchanged."""
    weight = torch.cat([l.weight.detach() for l in linears], dim=0)
    biases = [l.bias for l in linears]
    bias = torch.cat([b.detach() for b in biases], dim=0) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("cannot fuse linears where only some have a bias")
    offset = 0
    for l in linears:
        n = l.weight.shape[0]
        l.weight = torch.nn.Parameter(weight[offset : offset + n], requires_grad=False)
        if bias is not None:
            l.bias = torch.nn.Parameter(bias[offset : offset + n], requires_grad=False)
        offset += n
    return weight, bias
