"""Model resolution, the GGUF conversion cache, fingerprints and device checks."""

import os

import pytest
import torch

from conftest import char_tokenizer, tiny_hf_model, tiny_loaded
from kvforge.errors import DeviceError, KvforgeError, MissingPackageError, UnknownModelError
from kvforge.models import load_model, parse_dtype, resolve_device
from kvforge.models import loading
from kvforge.models.loading import model_fingerprint
from kvforge.models.registry import PackagedModel


def test_load_local_directory_gives_the_same_model(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), dtype="fp32")
    reference = tiny_hf_model("llama")
    ids = torch.randint(3, 97, (1, 12))
    with torch.inference_mode():
        assert torch.allclose(loaded.hf(ids).logits, reference(ids).logits, atol=1e-6)
    assert loaded.adapter.family == "llama"
    assert loaded.fingerprint == model_fingerprint(reference)


def test_bf16_load_keeps_the_fp32_fingerprint(tiny_model_dir):
    """Artifacts fitted on the fp32 model must load on its bf16 cast: same id, bf16 weights that
    round exactly as transformers' own bf16 load does, and an adapter fused from the bf16 weights."""
    from transformers import AutoModelForCausalLM

    fp32 = load_model(str(tiny_model_dir), dtype="fp32")
    bf16 = load_model(str(tiny_model_dir), dtype="bf16")
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert {p.dtype for p in bf16.hf.parameters()} == {torch.bfloat16}
    assert bf16.adapter.qkv[0][0].dtype == torch.bfloat16
    assert bf16.fingerprint == fp32.fingerprint == model_fingerprint(fp32.hf)
    assert model_fingerprint(bf16.hf) != fp32.fingerprint  # what the fp32-first load avoids
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
    for (name, p), q in zip(bf16.hf.named_parameters(), direct.parameters()):
        assert torch.equal(p, q), name
    buffers = dict(direct.named_buffers())  # rotary frequencies stay fp32 in transformers' own bf16 load
    assert {n for n, _ in bf16.hf.named_buffers()} == set(buffers)
    for name, b in bf16.hf.named_buffers():
        assert b.dtype == buffers[name].dtype and torch.equal(b, buffers[name]), name


def test_a_directory_fingerprint_is_the_loaded_models_without_loading_it(tmp_path, monkeypatch):
    """Streamed from the safetensors files, equal to hashing the fp32 model, cached by the files'
    sizes and mtimes; a rewritten weight file is hashed again."""
    from kvforge.models import streamed

    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path / "home"))
    model = tiny_hf_model("llama", seed=3)
    model.save_pretrained(tmp_path / "m")
    assert streamed.directory_fingerprint(tmp_path / "m") == model_fingerprint(model)
    monkeypatch.setattr(streamed, "read_parameters", lambda *args: pytest.fail("the cached id was not used"))
    assert streamed.directory_fingerprint(tmp_path / "m") == model_fingerprint(model)
    monkeypatch.undo()
    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path / "home"))
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.view(-1)[-1] += 1e-3
    model.save_pretrained(tmp_path / "m")
    assert streamed.directory_fingerprint(tmp_path / "m") == model_fingerprint(model)


def test_a_bf16_load_reads_the_weights_once_in_bf16(tiny_model_dir, monkeypatch, tmp_path):
    """No fp32 model is built on the way (it would double a large model's memory): each tensor
    goes from its file into a bf16 parameter, and the id comes from the same pass."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path / "home"))  # no cached id: the load's pass computes it
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded by from_pretrained"))
    monkeypatch.setattr(loading, "model_fingerprint", lambda model: pytest.fail("hashed the loaded weights"))
    bf16 = load_model(str(tiny_model_dir), dtype="bf16")
    assert {p.dtype for p in bf16.hf.parameters()} == {torch.bfloat16}
    assert bf16.fingerprint == model_fingerprint(tiny_hf_model("llama"))


def test_a_tensor_read_in_parts_loads_and_hashes_as_one(tmp_path, monkeypatch):
    """Rows read a few at a time land where they belong and hash as the whole tensor does."""
    from kvforge.models import streamed

    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(streamed, "CHUNK_BYTES", 1000)  # a few rows of every matrix per part
    model = tiny_hf_model("llama", seed=5)
    model.save_pretrained(tmp_path / "m")
    loaded, fingerprint = streamed.load_streamed(tmp_path / "m", torch.float32)
    assert fingerprint == model_fingerprint(model)
    for (name, p), q in zip(loaded.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_saved_buffers_and_fp32_modules_take_from_pretrained(tmp_path):
    """What `from_pretrained` does beyond the parameters (a saved buffer; a module kept in fp32)
    is not the streamed load's to redo: it declines."""
    from kvforge.models import streamed

    model = tiny_hf_model("llama", seed=6)
    model.model.register_buffer("saved_scale", torch.ones(3))  # persistent: in state_dict, not a parameter
    assert not streamed._parameters_only(model)
    plain = tiny_hf_model("llama", seed=6)
    assert streamed._parameters_only(plain)
    plain._keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    assert not streamed._parameters_only(plain)


def test_a_checkpoint_of_another_layout_loads_through_transformers(tmp_path):
    """Files that do not name every parameter (here a .bin checkpoint) take from_pretrained."""
    model = tiny_hf_model("llama", seed=4)
    model.save_pretrained(tmp_path / "m", safe_serialization=False)
    char_tokenizer().save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), dtype="bf16")
    assert loaded.fingerprint == model_fingerprint(model)
    assert torch.equal(loaded.hf.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight.bfloat16())


def test_parse_dtype_names():
    assert parse_dtype("bf16") is parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("FP32") is parse_dtype("float32") is torch.float32
    assert parse_dtype("fp16") is torch.float16
    assert parse_dtype("auto") is None and parse_dtype(None) is None
    assert parse_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(KvforgeError, match="unknown dtype 'int8'"):
        parse_dtype("int8")
    with pytest.raises(KvforgeError, match="floating-point"):
        parse_dtype(torch.int8)


def test_bf16_on_a_cpu_without_it_warns_once(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(loading, "multiplies_natively", lambda name: False)
    monkeypatch.setattr(loading, "_warned", set())
    for _ in range(2):
        loading._warn_if_emulated(torch.device("cpu"), torch.bfloat16)
    assert capsys.readouterr().err.count("no native bfloat16 support") == 1
    loading._warn_if_emulated(torch.device("cpu"), torch.float32)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32), (None, torch.float32)])
def test_auto_is_bf16_where_the_cpu_multiplies_it(monkeypatch, tiny_model_dir, native, expected):
    monkeypatch.setattr(loading, "multiplies_natively", lambda name: native)
    assert loading.default_dtype(torch.device("cpu")) is expected
    assert load_model(str(tiny_model_dir)).dtype is load_model(str(tiny_model_dir), dtype="auto").dtype is expected


def test_cpu_flags_decide_native_bf16(monkeypatch, tmp_path):
    from kvforge import cpu

    for flags, native in (("fpu sse2 avx2", False), ("avx2 avx512f avx512_bf16", True), ("avx2 amx_bf16 amx_tile", True)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"model name : X\nflags : {flags}\n")
        monkeypatch.setattr(cpu, "CPUINFO", info)
        cpu.cpuinfo.cache_clear()
        assert cpu.multiplies_natively("bfloat16") is native
    cpu.cpuinfo.cache_clear()
    assert 1 <= cpu.all_cores() <= (os.cpu_count() or 1)


def test_fingerprint_tells_models_apart():
    assert model_fingerprint(tiny_hf_model("llama", seed=0)) != model_fingerprint(tiny_hf_model("llama", seed=1))
    assert model_fingerprint(tiny_hf_model("llama")) != model_fingerprint(tiny_hf_model("qwen3"))


def test_fingerprint_sees_a_change_to_the_last_value_of_one_weight():
    """A fine-tune that moves only late values must not pass as the base model."""
    model = tiny_hf_model("llama")
    base = model_fingerprint(model)
    weight = model.model.layers[-1].mlp.down_proj.weight  # (64, 96): its last value is far past any leading sample
    with torch.no_grad():
        weight.view(-1)[-1] += 1e-3
    assert model_fingerprint(model) != base


def test_a_loaded_model_computes_its_fingerprint_once(monkeypatch):
    loaded = tiny_loaded("llama")
    calls = []
    monkeypatch.setattr(loading, "model_fingerprint", lambda model, read=None: calls.append(model) or "id")
    assert [loaded.fingerprint for _ in range(3)] == ["id"] * 3 and calls == [loaded.hf]


def test_unknown_alias_lists_the_known_ones():
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        load_model("no-such-model")


def test_unreachable_hub_id_is_a_clear_error():
    with pytest.raises(UnknownModelError, match="cannot load model 'someorg/some-model'"):
        load_model("someorg/some-model")


def test_missing_gguf_and_bad_directory(tmp_path):
    with pytest.raises(UnknownModelError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(UnknownModelError, match="config.json"):
        load_model(str(tmp_path))


def test_missing_package_names_the_pip_command():
    fake = PackagedModel("fake", "d", ("kvforge-no-such-package",), "x.gguf", "pip install kvforge-no-such-package")
    assert not fake.installed()
    with pytest.raises(MissingPackageError, match="pip install kvforge-no-such-package"):
        fake.require()


def test_devices_that_are_not_here():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(DeviceError):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA GPU"):
            resolve_device("cuda")


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """A .gguf path whose 'conversion' saves a tiny model, counting calls."""
    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path / "home"))
    calls = []

    def convert(gguf_path, out):
        calls.append(gguf_path)
        tiny_hf_model("llama").save_pretrained(out)

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    return gguf, calls


def test_conversion_is_cached_and_left_whole(fake_conversion):
    gguf, calls = fake_conversion
    first = loading.converted_dir_for_gguf(gguf)
    second = loading.converted_dir_for_gguf(gguf)
    assert first == second and len(calls) == 1
    assert (first / loading.MANIFEST).is_file()
    siblings = [p.name for p in first.parent.iterdir()]
    assert siblings == [first.name]  # no temp directory left behind


def test_corrupt_conversion_is_detected_and_rebuilt(fake_conversion):
    gguf, calls = fake_conversion
    directory = loading.converted_dir_for_gguf(gguf)
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    weights.write_bytes(bytes(data))
    rebuilt = loading.converted_dir_for_gguf(gguf)
    assert rebuilt == directory and len(calls) == 2
    assert loading._manifest_ok(rebuilt)


def test_half_written_conversion_is_rebuilt(fake_conversion):
    gguf, calls = fake_conversion
    directory = loading.converted_dir_for_gguf(gguf)
    (directory / loading.MANIFEST).unlink()  # as if killed before the manifest was written
    loading.converted_dir_for_gguf(gguf)
    assert len(calls) == 2


def test_a_ggufs_add_bos_flag_is_read_for_the_converted_tokenizer(tmp_path):
    import gguf

    for flags in ({"add_bos_token": True, "add_eos_token": False}, {"add_bos_token": False}, {}):
        path = tmp_path / f"flags-{len(flags)}-{flags.get('add_bos_token')}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        for flag, value in flags.items():
            writer.add_bool(f"tokenizer.ggml.{flag}", value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert loading.gguf_special_token_flags(path) == flags
