"""Gated DeltaNet (the linear-attention layers of Qwen3-Next and Qwen3.5) run over kvforge's own
per-layer state.

Shapes: B batch, T tokens, E hidden size, C conv channels (q, k and v of all heads), K conv
kernel, Hk/Hv key/value heads, Dk/Dv their dims.

A layer mixes tokens through two states instead of K/V rows: the last K-1 inputs of a causal
depthwise convolution, and a recurrent matrix S (B, Hv, Dk, Dv) that every token decays and
updates by the delta rule. Weights and the recurrence's arithmetic are transformers' (its
modules, and the chunked and per-token gated delta rule functions of the model's own modeling
file); what is ours is where the state lives (`RecurrentLayerCache`) and which rows feed it.

A step keeps what rollback needs: the state before it, and after a short step (speculative
verification: at most `PER_TOKEN_STEPS` tokens) the state after each of its tokens. A short
step that continues a state runs token by token -- the same arithmetic as one-token decoding,
so verifying k drafts computes what k decode steps would, and speculative decoding stays
token-identical. Longer steps (prefill) run transformers' chunked form.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

PER_TOKEN_STEPS = 32


def project(module: torch.nn.Module, x: torch.Tensor, linear) -> tuple[torch.Tensor, ...]:
    """Normed input x (B, T, E) -> conv input (B, C, T), gate z (B, T, Hv, Dv), b and a (B, T, Hv).
    Qwen3-Next packs q, k, v, z per key-head group and b, a likewise (its module reorders them);
    Qwen3.5 has one projection each."""
    b_, t, _ = x.shape
    if hasattr(module, "in_proj_qkvz"):
        qkvz = linear(x, module.in_proj_qkvz.weight)
        ba = linear(x, module.in_proj_ba.weight)
        q, k, v, z, b, a = module.fix_query_key_value_ordering(qkvz, ba)
        mixed = torch.cat([q.reshape(b_, t, -1), k.reshape(b_, t, -1), v.reshape(b_, t, -1)], dim=-1)
    else:
        mixed = linear(x, module.in_proj_qkv.weight)
        z = linear(x, module.in_proj_z.weight).view(b_, t, -1, module.head_v_dim)
        b = linear(x, module.in_proj_b.weight)
        a = linear(x, module.in_proj_a.weight)
    return mixed.transpose(1, 2), z, b, a


def conv_window(conv_state: torch.Tensor, mixed: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """[state, new inputs] (B, C, K-1+T), what the conv reads. A sequence's leading padding rows
    (left padding in a batch) go in front of its state, so its real rows see their own history
    and not the padding's zero columns; their own outputs are never read. A fresh state is zeros,
    which is the zero padding transformers' prefill uses."""
    window = torch.cat([conv_state, mixed.to(conv_state.dtype)], dim=-1)
    if padding is None:
        return window
    width = conv_state.shape[-1]
    for b, lead in enumerate(_leading(padding).tolist()):
        if lead:
            window[b] = torch.cat([window[b, :, width : width + lead], conv_state[b], window[b, :, width + lead :]], dim=-1)
    return window


def _leading(padding: torch.Tensor) -> torch.Tensor:
    """(B,) how many of each sequence's first rows are padding."""
    return padding.int().cumprod(dim=1).sum(dim=1)


def convolve(module: torch.nn.Module, window: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The causal depthwise conv over a `conv_window` (B, C, K-1+T) -> activated (B, C, T)."""
    weight = module.conv1d.weight  # (C, 1, K)
    out = F.conv1d(window.to(weight.dtype), weight, module.conv1d.bias, groups=weight.shape[0])
    return F.silu(out).to(dtype) if module.activation == "silu" else _activation(module.activation)(out).to(dtype)


def recur(
    module: torch.nn.Module, conv_out: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state: torch.Tensor, per_token: bool,
    padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Conv output (B, C, T), b, a (B, T, Hv), the state before (B, Hv, Dk, Dv) fp32 -> core output
    (B, T, Hv, Dv) and the states after: one per token when `per_token`, else only the last.
    A padding row (bool (B, T)) neither decays nor writes the state (decay 1, write strength 0)."""
    rules = importlib.import_module(type(module).__module__)
    bsz, _, t = conv_out.shape
    q, k, v = conv_out.transpose(1, 2).split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(bsz, t, -1, module.head_k_dim)
    k = k.reshape(bsz, t, -1, module.head_k_dim)
    v = v.reshape(bsz, t, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)  # fp32 decay: fp16 A could be -inf
    if padding is not None:
        beta, g = beta.masked_fill(padding.unsqueeze(-1), 0), g.masked_fill(padding.unsqueeze(-1), 0)
    groups = module.num_v_heads // module.num_k_heads
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    if not per_token:
        out, last = rules.torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        return out, [last]
    outs, states = [], []
    for i in range(t):
        step = slice(i, i + 1)
        out, state = rules.torch_recurrent_gated_delta_rule(
            q[:, step], k[:, step], v[:, step], g=g[:, step], beta=beta[:, step], initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        outs.append(out)
        states.append(state)
    return torch.cat(outs, dim=1), states


def gated_output(module: torch.nn.Module, core: torch.Tensor, z: torch.Tensor, linear) -> torch.Tensor:
    """Core output and gate (B, T, Hv, Dv) -> the layer's mixer output (B, T, E): the gated
    RMSNorm per head, then the output projection."""
    bsz, t = core.shape[:2]
    normed = module.norm(core.reshape(-1, core.shape[-1]), z.reshape(-1, z.shape[-1]))
    return linear(normed.view(bsz, t, -1), module.out_proj.weight)


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]
