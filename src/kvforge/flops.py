"""Multiply-accumulate counts of a prefill plan: the speedup ceiling beside measured times, and
what a filled row costs a chunked prefill's budget (`filled_row_share`).

Per exact row and layer: q/k/v and output projections, the gated MLP (or a mixture of experts:
its router and the top-k experts) and attention over the keys
the row sees: the rows the layer holds (exact rows, and filled rows where the plan fills) at or
before its position, within its window. Summed over a causal prompt that is the quadratic
T(T+1)/2 keys per layer; above a SPEED cut the few full-depth rows see only each other. Per
filled row and late layer: the ridge map (E × E per map input: 2E × E when it also reads the
previous row's split state; none at the split layer, whose input is the split state itself) and the k/v projections, only on rows the layer writes (sliding-window layers
skip rows nothing reads); a map folded into the k/v projection (maps of the normed input) is one
multiply, map inputs × E by the k/v width. The head runs on the last row.

On a hybrid's linear-attention (Gated DeltaNet) layer an exact row costs its input projections,
the depthwise conv, the recurrence (decay, read, delta update and output read of a Dk × Dv state
per value head: 4 · Dk · Dv, whatever the prompt length), the output projection and the MLP; a
filled row still costs the map, the input projections, the conv and the state update (3 · Dk · Dv
per value head), and skips the output read, the output projection and the MLP. An absent row
costs nothing.

The ceiling is exact MACs / plan MACs: the speedup if time were proportional to MACs. Whatever
one layer costs (linear or quadratic), when the layers are alike and a plan drops whole layers
for most rows the ceiling is close to the layer ratio: a measured speedup above it means the arms
differ in something other than MACs, or noise. `decode_span_macs` gives the ceiling for time per
output token over the decode steps a TPOT averages.
"""

from __future__ import annotations

import torch

from kvforge.attention import readable_rows


def _dims(adapter) -> tuple[int, int, int, int, int]:
    c = adapter.config
    return adapter.hidden_size, adapter.num_heads * adapter.head_dim, adapter.kv_heads * adapter.head_dim, c.intermediate_size, c.vocab_size


def prefill_macs(adapter, depth: torch.Tensor, split: int | None, filled: bool, map_inputs: int = 1, folded: bool = False) -> int:
    """MACs of a prefill where row i runs layers [0, depth[i]) exactly; above it a row is filled
    (`filled`: from a map of `map_inputs` E-wide inputs at layers > split, the split state at the
    split layer) or absent. `folded`: an attention layer's map is folded into its K/V projection
    (maps of the normed input), one (map_inputs · E) × 2 kv-width multiply a row."""
    e, q_dim, _, _, vocab = _dims(adapter)
    t = depth.numel()
    positions = torch.arange(t)
    total = 0
    for layer in range(adapter.num_layers):
        per_row_linear = _per_row_linear(adapter, layer)
        active = depth > layer
        if adapter.is_recurrent(layer):
            total += int(active.sum()) * per_row_linear
            if filled:
                total += int((~active).sum()) * _filled_row(adapter, layer, split, map_inputs, folded)
            continue
        window = adapter.windows[layer]
        written = ~active & readable_rows(positions, active, window) if filled else torch.zeros_like(active)
        seen = _keys_seen(active | written, window)[active]
        # QKᵀ and AV: 2 · head dim per visible key per query head
        total += int(active.sum()) * per_row_linear + int(seen.sum()) * 2 * q_dim
        if filled:
            total += int(written.sum()) * _filled_row(adapter, layer, split, map_inputs, folded)
    return total + e * vocab


def _filled_row(adapter, layer: int, split: int | None, map_inputs: int, folded: bool) -> int:
    """One filled row's MACs at `layer`: its map (none at the split layer, whose input is the split
    state itself), then an attention layer's k/v projections (one multiply when the map is folded
    into them) or a recurrent layer's input projections, conv and state update."""
    e, _, kv_dim, _, _ = _dims(adapter)
    mapped = split is not None and layer > split
    map_macs = map_inputs * e * e if mapped else 0
    if adapter.is_recurrent(layer):
        state_in, state_update = _recurrent_row(adapter, layer)
        return map_macs + state_in + state_update
    return map_inputs * e * 2 * kv_dim if mapped and folded else map_macs + e * 2 * kv_dim


def filled_row_share(adapter, split: int, map_inputs: int = 1, folded: bool = False) -> float:
    """A filled row's MACs over layers [split, L) in exact rows: against an exact row's projections
    and MLPs over the same layers, attention left out of both (a prefill chunk's budget counts
    rows, whatever their attention costs). smollm2-135m at split 15: 0.15 for maps of one input,
    0.24 for two (the shipped maps); a hybrid's recurrent layer, whose filled rows still run their
    projections and state update, raises it."""
    filled = sum(_filled_row(adapter, layer, split, map_inputs, folded) for layer in range(split, adapter.num_layers))
    exact = sum(_per_row_linear(adapter, layer) for layer in range(split, adapter.num_layers))
    return filled / exact


def _keys_seen(present: torch.Tensor, window: int | None) -> torch.Tensor:
    """(T,) for each position, how many rows the layer holds (`present`, bool (T,)) at or before
    it and within its window: the keys a query there attends over."""
    upto = present.long().cumsum(0)
    if window is None or window >= present.numel():
        return upto
    before = torch.zeros_like(upto)
    before[window:] = upto[:-window]
    return upto - before


def decode_macs(adapter, cached_rows: list[int]) -> int:
    """MACs of one decode step over a cache holding `cached_rows[l]` rows at layer l: every layer's
    projections and MLP on one row, attention over the cached rows it sees plus itself, the head."""
    e, q_dim, _, _, vocab = _dims(adapter)
    total = 0
    for layer, rows in enumerate(cached_rows):
        if adapter.is_recurrent(layer):  # a fixed-size state, whatever the rows behind it
            total += _per_row_linear(adapter, layer)
            continue
        window = adapter.windows[layer]
        seen = rows + 1 if window is None else min(rows + 1, window)
        total += _per_row_linear(adapter, layer) + seen * 2 * q_dim
    return total + e * vocab


def decode_span_macs(adapter, cached_rows: list[int], steps: int) -> int:
    """MACs of `steps` greedy decode steps after a prefill that left `cached_rows[l]` rows at
    layer l: each step appends one row to every layer, so step i sees cached_rows + i."""
    return sum(decode_macs(adapter, [rows + i for rows in cached_rows]) for i in range(steps))


def _per_row_linear(adapter, layer: int) -> int:
    """One row's projections and MLP at `layer`; a mixture-of-experts MLP counts its router and the
    top-k experts a row runs through."""
    e, q_dim, kv_dim, ffn, _ = _dims(adapter)
    c = adapter.config
    if adapter.family == "deepseek_v3":
        raise ValueError("no MAC count for multi-head latent attention (deepseek_v3) yet")
    if adapter.gate_up[layer] is None:
        if not hasattr(c, "num_experts_per_tok"):
            raise ValueError(f"no MAC count for layer {layer}'s MLP ({type(adapter.layers[layer].mlp).__name__})")
        shared = getattr(c, "shared_expert_intermediate_size", 0) or 0  # Qwen3-Next: a shared expert and its gate
        mlp = e * c.num_experts + c.num_experts_per_tok * 3 * e * c.moe_intermediate_size + (3 * e * shared + e if shared else 0)
    else:
        mlp = 3 * e * ffn
    if adapter.is_recurrent(layer):
        m = adapter.layers[layer].linear_attn
        state_in, state_update = _recurrent_row(adapter, layer)
        return state_in + state_update + m.num_v_heads * m.head_k_dim * m.head_v_dim + m.value_dim * e + mlp
    # the fused q/k/v projection's width (a gated query doubles q's)
    return e * adapter.qkv[layer][0].shape[0] + q_dim * e + mlp


def _recurrent_row(adapter, layer: int) -> tuple[int, int]:
    """A DeltaNet row's MACs up to its state: input projections and conv, then the state update
    (decay, read, delta write of a Dk x Dv state per value head)."""
    m = adapter.layers[layer].linear_attn
    e = adapter.hidden_size
    projections = e * (m.conv_dim + m.value_dim + 2 * m.num_v_heads)  # q, k, v; z; b, a
    return projections + m.conv_dim * m.conv_kernel_size, 3 * m.num_v_heads * m.head_k_dim * m.head_v_dim


def exact_macs(adapter, tokens: int) -> int:
    return prefill_macs(adapter, torch.full((tokens,), adapter.num_layers), None, False)
