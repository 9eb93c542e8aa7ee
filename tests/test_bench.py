"""The bench machinery: MAC ceilings (tables), the interleaving harness, and the exact and SPEED
benches on a tiny model (logic and report contents, not timings)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_hf_model, tiny_loaded
from kvforge.bench.exact import _logit_diff, bench_exact
from kvforge.flops import _keys_seen, decode_macs, decode_span_macs, exact_macs, filled_row_share, prefill_macs
from kvforge.bench.harness import interleaved_metric_medians, interleaved_samples
from kvforge.bench.speed import bench_speed
from kvforge.cli import app
from kvforge.engine import Engine
from kvforge.fill.speed import SpeedConfig, speed_plan
from kvforge.ops import kernels

T = 40


@pytest.mark.parametrize(
    "present, window, seen",
    [
        ([1, 1, 1, 1, 1], None, [1, 2, 3, 4, 5]),  # causal: position + 1
        ([1, 1, 1, 1, 1], 2, [1, 2, 2, 2, 2]),  # sliding window
        ([1, 0, 0, 1, 1], None, [1, 1, 1, 2, 3]),  # absent rows are not keys
        ([1, 0, 0, 1, 1], 2, [1, 1, 0, 1, 2]),
        ([1, 1, 1], 8, [1, 2, 3]),  # a window longer than the prompt
    ],
)
def test_keys_seen(present, window, seen):
    assert _keys_seen(torch.tensor(present, dtype=torch.bool), window).tolist() == seen


def _by_hand(adapter, depth: torch.Tensor) -> int:
    """SPEED prefill MACs counted row by row: an active row attends over the active rows up to it."""
    e, q_dim = adapter.hidden_size, adapter.num_heads * adapter.head_dim
    kv_dim, ffn = adapter.kv_heads * adapter.head_dim, adapter.config.intermediate_size
    linear = e * (q_dim + 2 * kv_dim) + q_dim * e + 3 * e * ffn
    total = 0
    for layer in range(adapter.num_layers):
        rows = [i for i in range(depth.numel()) if depth[i] > layer]
        for n, _ in enumerate(rows):
            total += linear + (n + 1) * 2 * q_dim
    return total + e * adapter.config.vocab_size


def test_speed_macs_count_only_the_rows_each_layer_holds():
    adapter = tiny_loaded("llama").adapter
    L = adapter.num_layers
    assert prefill_macs(adapter, speed_plan(T, SpeedConfig(cut=L), L).depth, None, False) == exact_macs(adapter, T)
    for cut in range(1, L):
        depth = speed_plan(T, SpeedConfig(cut=cut, first=2, tail=3), L).depth
        assert prefill_macs(adapter, depth, None, False) == _by_hand(adapter, depth)
        # identical layers: the ceiling stays under the layer ratio (the head and the deep rows cost)
        assert 1 < exact_macs(adapter, T) / prefill_macs(adapter, depth, None, False) < L / cut


def test_a_mixture_of_experts_layer_counts_its_router_and_top_k_experts():
    adapter = tiny_loaded("qwen3_moe").adapter
    c = adapter.config
    e, q_dim, kv_dim = adapter.hidden_size, adapter.num_heads * adapter.head_dim, adapter.kv_heads * adapter.head_dim
    attn = e * (q_dim + 2 * kv_dim) + q_dim * e
    dense, moe = attn + 3 * e * c.intermediate_size, attn + e * c.num_experts + c.num_experts_per_tok * 3 * e * c.moe_intermediate_size
    kinds = [adapter.gate_up[layer] is None for layer in range(adapter.num_layers)]
    assert kinds == [False, True, False, True]  # decoder_sparse_step 2
    per_layer_attention = T * (T + 1) // 2 * 2 * q_dim
    expected = sum(T * (moe if k else dense) + per_layer_attention for k in kinds) + e * c.vocab_size
    assert exact_macs(adapter, T) == expected


def test_ridgefill_macs_unchanged_where_every_row_is_present():
    """Filled rows are keys too: a fill plan's attention is the causal count at every layer."""
    adapter = tiny_loaded("llama").adapter
    depth = torch.full((T,), adapter.num_layers)
    depth[2:-4] = 2
    e, q_dim, kv_dim = adapter.hidden_size, adapter.num_heads * adapter.head_dim, adapter.kv_heads * adapter.head_dim
    ffn = adapter.config.intermediate_size
    linear = e * (q_dim + 2 * kv_dim) + q_dim * e + 3 * e * ffn
    expected = e * adapter.config.vocab_size
    for layer in range(adapter.num_layers):
        active = (depth > layer).nonzero().view(-1)
        expected += len(active) * linear + int((active + 1).sum()) * 2 * q_dim
        filled = T - len(active)
        expected += filled * ((e * e if layer > 2 else 0) + e * 2 * kv_dim)
    assert prefill_macs(adapter, depth, 2, True) == expected


def _tiny_hybrid_rows(adapter) -> dict[str, int]:
    """qwen3_5 tiny, counted by hand: layers 0-2 Gated DeltaNet (E 64; q, k 2 heads x 8, v 4 heads
    x 8; conv 4), layer 3 gated full attention. A DeltaNet row up to its state (projections, conv),
    the value heads' Dk x Dv states (their size), an exact DeltaNet row and an exact attention row."""
    e, mlp, value_dim = 64, 3 * 64 * adapter.config.intermediate_size, 32
    conv_dim, state = 2 * 16 + value_dim, 4 * 8 * 8
    into_state = e * (conv_dim + value_dim + 2 * 4) + conv_dim * 4  # projections, conv
    q_dim, kv_dim = 4 * 16, 2 * 16
    return {"e": e, "q_dim": q_dim, "kv_dim": kv_dim, "into_state": into_state, "state": state,
            "exact_row": into_state + 3 * state + state + value_dim * e + mlp,  # update, read, out_proj, MLP
            "attention_row": e * (2 * q_dim + 2 * kv_dim) + q_dim * e + mlp}  # the query projection also yields the gate


def test_a_hybrid_counts_deltanet_rows_by_hand():
    """The tiny qwen3_5 (`_tiny_hybrid_rows`): RidgeFill at split 1 fills rows 2..T-5 above layer 1."""
    adapter = tiny_loaded("qwen3_5").adapter
    rows = _tiny_hybrid_rows(adapter)
    e, q_dim, kv_dim, into_state, state = (rows[k] for k in ("e", "q_dim", "kv_dim", "into_state", "state"))
    exact_row, attention_row = rows["exact_row"], rows["attention_row"]
    head = e * adapter.config.vocab_size
    assert exact_macs(adapter, T) == 3 * T * exact_row + T * attention_row + T * (T + 1) // 2 * 2 * q_dim + head
    depth = torch.full((T,), 4)
    depth[2:-4] = 1  # rows 0, 1 and the last 4 exact; split 1
    n = T - 6
    expected = T * exact_row  # layer 0
    expected += 6 * exact_row + n * (into_state + 3 * state)  # layer 1 = split: the split state itself is the input
    expected += 6 * exact_row + n * (e * e + into_state + 3 * state)  # layer 2: the map, then the state update only
    keys = 1 + 2 + (T - 3) + (T - 2) + (T - 1) + T  # layer 3: exact rows see every row up to theirs
    expected += 6 * attention_row + keys * 2 * q_dim + n * (e * e + e * 2 * kv_dim)
    assert prefill_macs(adapter, depth, 1, True) == expected + head


def test_a_filled_rows_share_of_a_chunk_counts_its_late_layers_by_hand():
    """What a filled row costs a chunk's budget, in exact rows over layers [split, L), attention
    left out of both: llama (4 layers, split 2) writes K/V at the split layer, a map and K/V above
    it; folded maps are one multiply. On the hybrid (split 1) the recurrent layers' filled rows run
    their projections, conv and state update: a larger share than an attention layer's."""
    adapter = tiny_loaded("llama").adapter
    e, q_dim, kv_dim = adapter.hidden_size, adapter.num_heads * adapter.head_dim, adapter.kv_heads * adapter.head_dim
    linear = e * (q_dim + 2 * kv_dim) + q_dim * e + 3 * e * adapter.config.intermediate_size
    filled = e * 2 * kv_dim + (e * e + e * 2 * kv_dim)
    assert filled_row_share(adapter, 2) == pytest.approx(filled / (2 * linear))
    assert filled_row_share(adapter, 2, map_inputs=2) == pytest.approx((filled + e * e) / (2 * linear))
    assert filled_row_share(adapter, 2, folded=True) == pytest.approx((e * 2 * kv_dim + e * 2 * kv_dim) / (2 * linear))
    assert filled_row_share(adapter, 2, map_inputs=0) == pytest.approx(2 * e * 2 * kv_dim / (2 * linear))  # the identity fill
    hybrid = tiny_loaded("qwen3_5").adapter
    rows = _tiny_hybrid_rows(hybrid)
    e, kv_dim, to_state = rows["e"], rows["kv_dim"], rows["into_state"] + 3 * rows["state"]
    filled = to_state + (e * e + to_state) + (e * e + e * 2 * kv_dim)  # layers 1, 2 recurrent; 3 attention
    assert filled_row_share(hybrid, 1) == pytest.approx(filled / (2 * rows["exact_row"] + rows["attention_row"]))
    assert filled_row_share(hybrid, 1) > filled_row_share(tiny_loaded("llama").adapter, 2)


def test_decode_span_macs_sums_the_growing_steps():
    adapter = tiny_loaded("gemma3").adapter  # sliding-window layers: the window caps what a step reads
    rows = [30, 30, 5, 5]
    assert decode_span_macs(adapter, rows, 1) == decode_macs(adapter, rows)
    assert decode_span_macs(adapter, rows, 4) == sum(decode_macs(adapter, [r + i for r in rows]) for i in range(4))
    assert decode_span_macs(adapter, rows, 0) == 0


def test_interleaving_rotates_and_never_repeats_an_arm_back_to_back():
    calls = []

    def arm(name):
        def run():
            calls.append(name)
            return {"s": float(len(calls))}

        return run

    samples = interleaved_samples({n: arm(n) for n in "abcd"}, runs=5, warmup=1)
    assert calls[:8] == list("abcd") + list("bcda")
    assert all(x != y for x, y in zip(calls, calls[1:]))
    assert {n: len(s) for n, s in samples.items()} == {n: 5 for n in "abcd"}
    calls.clear()
    medians = interleaved_metric_medians({n: arm(n) for n in "ab"}, runs=3, warmup=0)
    assert calls == list("abbaab") and medians == {"a": {"s": 4.0}, "b": {"s": 3.0}}
    with pytest.raises(ValueError, match="runs"):
        interleaved_samples({"a": arm("a")}, runs=0)


def test_logit_diff_covers_every_position():
    ours = torch.zeros(1, 5, 7)
    theirs = torch.zeros(1, 5, 7)
    theirs[0, 1, 3] = -0.5  # an early position: missed by a last-position check
    theirs[0, 4, 0] = 0.25
    assert _logit_diff(ours, theirs) == {"all": 0.5, "last": 0.25}
    with pytest.raises(ValueError, match="shape"):
        _logit_diff(torch.zeros(1, 4, 7), theirs)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "deepseek_v3"])  # K/V rows, recurrent states, latents
def test_bench_exact_reports_parity_over_all_positions(family):
    engine = Engine(tiny_loaded(family))
    report = bench_exact(engine, [T], runs=1, decode_tokens=2)
    (row,) = report["results"]
    assert row["max_abs_logit_diff"] < 1e-3 and row["max_abs_logit_diff_last"] <= row["max_abs_logit_diff"]
    assert row["kv_bytes"] == row["kv_bytes_expected"]
    json.dumps(report)


def test_bench_speed_ceilings_and_per_round_speedups():
    engine = Engine(tiny_loaded("llama"))
    L = engine.num_layers
    report = bench_speed(engine, [SpeedConfig(cut=2, tail=1), SpeedConfig(cut=L, tail=1)], [T], runs=2, decode_tokens=3)
    row, full = report["results"]
    assert (row["prefill"], row["reason"], row["shallow_rows"]) == ("speed", None, T - 2)
    assert full["prefill"] == "exact" and "is the model's depth" in full["reason"] and full["shallow_rows"] == 0
    assert len(row["ttft_speedup_runs"]) == len(row["tpot_speedup_runs"]) == 2
    exact_rows = [T] * L
    speed_rows = engine.prefill([list(range(3, 3 + T))], plan=speed_plan(T, SpeedConfig(cut=2, tail=1), L))[1].lengths()
    assert speed_rows == [T, T, 2, 2]
    expected = decode_span_macs(engine.adapter, exact_rows, 3) / decode_span_macs(engine.adapter, speed_rows, 3)
    assert row["tpot_ceiling"] == pytest.approx(expected)
    assert 1 < row["ttft_ceiling"] < L / 2
    json.dumps(report)


def test_bench_exact_json_is_the_last_stdout_line(tiny_model_dir):
    result = CliRunner().invoke(app, ["bench", "exact", "--model", str(tiny_model_dir), "--tokens", "40", "--runs", "1", "--decode-tokens", "2", "--dtype", "fp32", "--json"])
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout.strip().splitlines()[-1])
    assert obj["command"] == "bench exact" and obj["results"][0]["max_abs_logit_diff"] < 1e-3


def test_bench_peers_rows_for_every_engine_dtype_and_length(monkeypatch):
    import sys

    import kvforge.bench.peers as peers

    monkeypatch.setitem(sys.modules, "vllm", None)  # find_spec then says: not installed, even where it is
    loaded = []
    report = peers.bench_peers(
        "tiny-llama", [12, 20], engines=("kvforge", "transformers", "vllm"), decode_tokens=3, runs=1, copy_new_tokens=4,
        load_engine=lambda dtype: loaded.append(dtype) or Engine(tiny_loaded("llama", dtype=dtype)),
        copy_prompt_ids=[[5, 6, 7, 8], [9, 10, 11]],
    )
    assert loaded == [torch.float32, torch.bfloat16]
    assert [(s["engine"], s["dtype"]) for s in report["skipped"]] == [("vllm", "fp32"), ("vllm", "bf16")]
    assert all(s["reason"].startswith("vllm not installed") for s in report["skipped"])
    keys = {(r["engine"], r["dtype"], r["tokens"]) for r in report["results"]}
    assert keys == {(e, d, t) for e in ("kvforge", "transformers") for d in ("fp32", "bf16") for t in (12, 20)}
    assert report["copy_workload"]["generated_tokens"] == {"kvforge": 8, "transformers": 8}
    for row in report["results"]:
        for figure in ("prefill_tokens_per_s", "decode_tokens_per_s", "copy_tokens_per_s"):
            assert row[figure] > 0, (row, figure)
        if row["engine"] == "kvforge":
            assert row["ratio_to_vllm"] is None and set(row["ratio_to_transformers"]) == {"prefill", "decode", "copy"}
            assert all(row["step_cost"][key] > 0 for key in ("one_s", "verify_9", "batch_16", "batch_16_distinct"))
        else:
            assert "ratio_to_vllm" not in row and "step_cost" not in row
    assert report["command"] == "bench peers" and report["threads"] >= 1 and report["vllm"] is None
    table = peers.markdown_table(report)
    assert table.count("\n") == 1 + 4 + 3 + 4 and "prefill tok/s @20" in table and "9-row verify" in table
    json.dumps(report)


def test_bench_peers_rejects_a_bad_dtype_with_one_line():
    result = CliRunner().invoke(app, ["bench", "peers", "--dtypes", "fp32,fp8", "--tokens", "16"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--dtypes" in lines[0] and "'fp8'" in lines[0], result.stderr


def test_bench_load_measures_a_load_in_a_fresh_process(tiny_model_dir):
    from kvforge.bench.loading import bench_load
    from kvforge.models.loading import model_fingerprint

    report = bench_load(str(tiny_model_dir), ["bf16", "fp32"], threads=1)
    bf16, fp32 = report["results"]
    assert (bf16["dtype"], fp32["dtype"]) == ("bfloat16", "float32")
    assert fp32["weight_bytes"] == 2 * bf16["weight_bytes"] > 0 and fp32["parameters"] == bf16["parameters"]
    assert bf16["fingerprint"] == fp32["fingerprint"] == model_fingerprint(tiny_hf_model("llama"))
    assert bf16["peak_above_import_bytes"] >= bf16["tokenizer_peak_bytes"] > 0
    assert fp32["released_bytes"] == 0  # fp32 keeps no packed copy to run from
    assert (bf16["released_bytes"] > 0) == (kernels.kind() != "none")  # the projections' bf16 bytes, kept packed only
    assert bf16["rss_decoding_bytes"] > 0 and bf16["rss_decoding_released_over_weights"] > 0
    with pytest.raises(ValueError, match="failed"):
        bench_load(str(tiny_model_dir) + "-missing", ["bf16"], threads=1)
