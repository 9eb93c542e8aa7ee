"""llama.cpp as a `bench peers` engine: the re-typed GGUF holds the weights kvforge runs, and the
engine is skipped with its reason where llama-cpp-python is missing or the model has no GGUF."""

import sys

import gguf
import numpy as np
import pytest
import torch

from conftest import tiny_loaded
from kvforge.bench import llama_cpp, peers


def _tiny_gguf(path, rng):
    """A GGUF with an f16 matrix, an f32 vector and metadata of several kinds."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_token_list(["<a>", "b", "c"])
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    matrix = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_up.weight", matrix.astype(np.float16))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tensors(path):
    reader = gguf.GGUFReader(path)
    return reader, {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}


@pytest.mark.parametrize("weights", ["bf16", "fp32", "q8_0"])
def test_retyped_gguf_keeps_metadata_and_stores_matrices_as_asked(tmp_path, weights):
    source, out = tmp_path / "m.gguf", tmp_path / f"m-{weights}.gguf"
    _tiny_gguf(source, np.random.default_rng(0))
    llama_cpp.write_retyped(source, out, weights)
    src_reader, src = _tensors(source)
    out_reader, got = _tensors(out)
    kind, matrix = got["blk.0.ffn_up.weight"]
    exact = src["blk.0.ffn_up.weight"][1]
    assert kind.name == {"bf16": "BF16", "fp32": "F32", "q8_0": "Q8_0"}[weights]
    if weights == "bf16":  # what kvforge's bf16 engine holds: the dequantized fp32 rounded to nearest even
        assert np.array_equal(matrix, torch.from_numpy(exact).to(torch.bfloat16).float().numpy())
    elif weights == "fp32":
        assert np.array_equal(matrix, exact)
    else:
        assert 0 < np.abs(matrix - exact).max() < np.abs(exact).max() / 100  # re-quantized, at Q8_0's precision
    assert got["blk.0.attn_norm.weight"][0].name == "F32" and np.array_equal(got["blk.0.attn_norm.weight"][1], src["blk.0.attn_norm.weight"][1])
    file_type = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "fp32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weights]
    assert out_reader.fields["general.file_type"].contents() == int(file_type)
    for name in ("general.architecture", "llama.block_count", "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.tokens"):
        assert out_reader.fields[name].contents() == src_reader.fields[name].contents()


def test_bench_peers_skips_llama_cpp_with_its_reason(monkeypatch):
    from kvforge.engine import Engine

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails, even where it is installed
    report = peers.bench_peers(
        "tiny-llama", [12], dtypes=("bf16",), engines=("kvforge", "llama.cpp", "llama.cpp-q8_0"), decode_tokens=2, runs=1,
        copy_new_tokens=2, load_engine=lambda dtype: Engine(tiny_loaded("llama", dtype=dtype)), copy_prompt_ids=[[5, 6, 7]],
    )
    assert [(s["engine"], s["dtype"]) for s in report["skipped"]] == [("llama.cpp", "bf16"), ("llama.cpp-q8_0", "bf16")]
    assert all("make llama-cpp" in s["reason"] for s in report["skipped"])
    assert {r["engine"] for r in report["results"]} == {"kvforge"}
    monkeypatch.setattr(llama_cpp, "llama_cpp_missing", lambda: None)
    assert "not a GGUF model" in peers._llama_cpp_reason("tiny-llama")
    assert report["llama_cpp"] is None


@pytest.mark.slow
def test_llama_cpp_runs_the_weights_kvforge_runs():
    """llama.cpp on the bf16 GGUF computes the logits kvforge's fp32 engine does, within bf16's
    rounding, and `bench peers` times it beside kvforge."""
    pytest.importorskip("llama_cpp", exc_type=ImportError)
    from kvforge.data.prompts import held_out_text_tokens
    from kvforge.engine import Engine
    from kvforge.models import load_model

    engine = Engine(load_model("smollm2-135m", dtype=torch.float32))
    ids = held_out_text_tokens(engine.model.tokenizer, 48)
    reference = engine.prefill(torch.tensor([ids]))[0][0]  # the last row's logits
    cpp = llama_cpp.LlamaCpp(llama_cpp.retyped_gguf(llama_cpp.gguf_source("smollm2-135m"), "bf16"), threads=1, n_ctx=128)
    cpp.prefill(ids)
    logits = torch.from_numpy(np.ctypeslib.as_array(cpp._lib.llama_get_logits_ith(cpp.llm.ctx, -1), shape=(cpp.vocab,)).copy())
    cpp.close()
    assert int(logits.argmax()) == int(reference.argmax())
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()

    report = peers.bench_peers("smollm2-135m", [32], dtypes=("bf16",), engines=("kvforge", "llama.cpp", "llama.cpp-q8_0"),
                               decode_tokens=2, runs=1, copy_new_tokens=3, copy_prompt_ids=[ids[:16]])
    assert not report["skipped"]
    rows = {r["engine"]: r for r in report["results"]}
    assert set(rows) == {"kvforge", "llama.cpp", "llama.cpp-q8_0"}
    assert all(rows[e]["prefill_tokens_per_s"] > 0 and rows[e]["decode_tokens_per_s"] > 0 for e in rows)
    assert report["copy_workload"]["generated_tokens"] == {"kvforge": 3, "llama.cpp": 3, "llama.cpp-q8_0": 3}
    assert set(rows["kvforge"]["ratio_to_llama.cpp-q8_0"]) == {"prefill", "decode", "copy"}
    assert all(isinstance(rows[e]["extra_buffers"], bool) for e in ("llama.cpp", "llama.cpp-q8_0"))
    assert report["llama_cpp"]["llama_cpp_python"] and report["llama_cpp"]["llama_cpp_system"]
