"""llama.cpp as a `bench peers` engine, through llama-cpp-python (an optional install: `make llama-cpp`).

llama.cpp reads GGUF, so its file is the model's own GGUF (the packaged file, or the `.gguf` given
as the model) with every matrix re-typed: dequantized to fp32 by gguf's own numpy code, then
stored as bf16, f32 or Q8_0; vectors (norms) stay f32, as llama.cpp's converter keeps them.
kvforge loads the same GGUF through the same dequantization and casts to its dtype, so the bf16
file holds the bf16 weights kvforge multiplies (both round to nearest even), and Q8_0 is what a
llama.cpp user would quantize them to. A model given as a Hugging Face directory has no GGUF
here: llama.cpp's `convert_hf_to_gguf.py` writes one, to be passed as the model.

Timing, on the same token ids as the other engines and the same thread count:
  - prefill: the prompt from an empty cache (`Llama.eval`, batches of `SETTINGS["n_batch"]` rows);
  - decode: greedy steps after that prefill, one token each, argmax of the last row's logits;
  - copy: prompt then greedy tokens, end of sequence ignored, as the other engines' copy arms.
Settings: llama-cpp-python's defaults (flash attention off, an f16 KV cache, micro-batches of 512
rows) with a logical batch of 2048 rows, llama.cpp's own default.

llama.cpp repacks quantized weights into "extra buffer types" (AMX tiles on an AMX Xeon, interleaved
blocks for AVX2/AVX-512) where its build has them. On an AMX Xeon its AMX buffer crashed the process
on a prompt of Q8_0 or Q4_1 smollm2-135m (https://github.com/ggml-org/llama.cpp/issues/20824 reports
a segfault in `ggml_backend_amx_mul_mat` too), so each file is first tried with them in a child process
(`extra_buffers_work`): where the child dies, the file runs without them, and the JSON says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvforge.paths import kvforge_home

N_UBATCH = 512
SETTINGS = {"n_batch": 2048, "n_ubatch": N_UBATCH, "flash_attn": False}  # every context's; the KV cache keeps llama.cpp's f16
RETYPE_VERSION = 1  # in a re-typed file's cache key, with gguf's version: a change of either writes the file anew
WEIGHTS = ("bf16", "fp32", "q8_0")  # what a re-typed GGUF's matrices are stored as


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot be timed here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # not installed, or its shared library fails to load
        return f"llama-cpp-python is not usable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): install it with `make llama-cpp`"
    return None


def gguf_source(model: str) -> Path | None:
    """The GGUF file a model spec comes from: the packaged file (joined once into kvforge's cache)
    or the `.gguf` given; None for a directory or hub id."""
    from kvforge.models.registry import PACKAGED_MODELS

    if model in PACKAGED_MODELS:
        packaged = PACKAGED_MODELS[model]
        return _written_once(kvforge_home() / "llama.cpp" / f"{model}-{packaged.version()}.gguf", packaged.write_gguf)
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def retyped_gguf(source: Path, weights: str) -> Path:
    """`source` with its matrices stored as `weights` (bf16, fp32 or q8_0), cached in kvforge's
    home by the source's path, size and modification time, gguf's version and `RETYPE_VERSION`."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown GGUF weight type {weights!r}: use {', '.join(WEIGHTS)}")
    from importlib.metadata import version

    stat = source.resolve().stat()
    key = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{version('gguf')}:{RETYPE_VERSION}"
    out = kvforge_home() / "llama.cpp" / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}-{weights}.gguf"
    return _written_once(out, lambda tmp: write_retyped(source, tmp, weights))


def _written_once(out: Path, write) -> Path:
    """`out`, written by `write(path)` into a temporary file first if it does not exist yet (a
    file there is whole: it is renamed into place)."""
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            write(tmp)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out


def write_retyped(source: Path, out: Path, weights: str) -> None:
    """Copy `source`'s metadata and tensors to `out`, each matrix dequantized and stored as `weights`."""
    import gguf

    target = {"bf16": gguf.GGMLQuantizationType.BF16, "fp32": gguf.GGMLQuantizationType.F32,
              "q8_0": gguf.GGMLQuantizationType.Q8_0}[weights]
    file_type = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "fp32": gguf.LlamaFileType.ALL_F32,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weights]
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    if gguf.Keys.General.FILE_TYPE not in reader.fields:
        writer.add_file_type(int(file_type))
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        kind = target if values.ndim >= 2 and values.shape[-1] % 32 == 0 else gguf.GGMLQuantizationType.F32
        stored = values if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(values, kind)
        writer.add_tensor(tensor.name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@lru_cache(maxsize=None)
def extra_buffers_work(path: Path, threads: int) -> bool:
    """Whether llama.cpp survives `path` with its extra buffer types at `threads` threads, tried
    in a child process (a crash there is a segfault, which would take this process with it): a
    prompt longer than a micro-batch, then a few one-token steps. A child that fails without a
    signal (kvforge or llama-cpp-python not importable there) is an error, not a crash."""
    rows = N_UBATCH + 16
    probe = (f"from kvforge.bench.llama_cpp import LlamaCpp; m = LlamaCpp({str(path)!r}, {threads}, {rows + 16}, extra_buffers=True); "
             f"m.decode(list(range(1, {rows + 1})), 4); m.close()")
    try:
        child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return False
    if child.returncode > 0:
        last = child.stderr.strip().splitlines()[-1] if child.stderr.strip() else f"exit status {child.returncode}"
        raise RuntimeError(f"llama.cpp's probe of {path.name} failed: {last}")
    return child.returncode == 0


@contextlib.contextmanager
def _model_params(use_extra_bufts: bool):
    """llama-cpp-python's `Llama` takes no `use_extra_bufts`: its default model parameters are
    wrapped while one model is constructed."""
    import llama_cpp.llama as wrapper

    default = wrapper.llama_cpp.llama_model_default_params

    def params():
        chosen = default()
        chosen.use_extra_bufts = use_extra_bufts
        return chosen

    wrapper.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        wrapper.llama_cpp.llama_model_default_params = default


class LlamaCpp:
    """One llama.cpp model and context, timed on token ids. `extra_buffers`: None, llama.cpp's
    repacked weight buffers where a child process survives them (`extra_buffers_work`)."""

    def __init__(self, path: Path | str, threads: int, n_ctx: int, extra_buffers: bool | None = None):
        import llama_cpp

        self._lib = llama_cpp
        self.extra_buffers = extra_buffers_work(Path(path), threads) if extra_buffers is None else extra_buffers
        with _model_params(self.extra_buffers):
            self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **SETTINGS)
        self.vocab = self.llm.n_vocab()

    def prefill(self, ids: list[int]) -> None:
        self.llm.reset()  # the next eval starts at row 0 and drops the cache's rows past it
        self.llm.eval(ids)

    def _next_token(self) -> int:
        logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.vocab,))
        return int(logits.argmax())

    def decode(self, ids: list[int], steps: int) -> float:
        """Seconds for `steps` greedy one-token steps after a prefill of `ids` (not timed)."""
        self.prefill(ids)
        token = self._next_token()
        start = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([token])
            token = self._next_token()
        return time.perf_counter() - start

    def generate(self, prompts: list[list[int]], new_tokens: int) -> int:
        """Greedy continuations of each prompt, `new_tokens` each: the tokens generated."""
        generated = 0
        for p in prompts:
            self.prefill(p)
            for i in range(new_tokens):
                token = self._next_token()
                generated += 1
                if i + 1 < new_tokens:
                    self.llm.eval([token])
        return generated

    def close(self) -> None:
        self.llm.close()


def versions() -> dict:
    """llama-cpp-python's version, the CPU features its ggml build uses and the context settings."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    return {"llama_cpp_python": llama_cpp.__version__, "llama_cpp_system": info.decode() if isinstance(info, bytes) else str(info),
            **SETTINGS, "kv_cache": "f16"}
