"""Loading a Hugging Face directory's safetensors files one tensor at a time, straight into the
requested dtype.

transformers' `from_pretrained` maps each weight file whole, and the pages it reads stay in the
process's resident set until the file is closed: a bf16 load of an fp32 checkpoint peaks near
three times the bf16 weights (SmolLM2-135M: 0.94 GB above the import for 0.27 GB). Here the model
is built with its parameters left uninitialised (its computed buffers, such as RoPE's inverse
frequencies, made exactly as `from_pretrained` makes them), and each parameter is read from its
file in parts of at most 64 MB, the file opened for each part alone, and copied into place with
one rounding: the peak is the weights plus one part. The same pass hashes each tensor for the
model's fingerprint (`directory_fingerprint` reads the files for the id alone, with no weights in
memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from kvforge.models.fingerprint import cache_fingerprint, cached_fingerprint, hash_tensor, hash_values, hasher, model_fingerprint


def tensor_index(directory: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Each tensor's name -> (the safetensors file of `directory` that holds it, its shape)."""
    from safetensors import safe_open

    index = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            index.update({key: (path, tuple(f.get_slice(key).get_shape())) for key in f.keys()})
    return index


CHUNK_BYTES = 64 << 20  # rows read at once from a large tensor: the transient beside the weights


def read_parameters(model: torch.nn.Module, directory: Path) -> Iterator[tuple[str, torch.nn.Parameter, Iterator[torch.Tensor]]] | None:
    """(name, parameter, its rows as stored, in order) for each of `model`'s parameters, read in
    parts of at most `CHUNK_BYTES` (a 262K-token embedding is 0.67 GB in fp32: read whole, it would
    sit beside the weights); None where the files do not hold every parameter under its name and
    shape (another checkpoint layout: the caller falls back to `from_pretrained`)."""
    from safetensors import safe_open

    index = tensor_index(directory)
    params = list(model.named_parameters())  # tied parameters once, as the fingerprint counts them
    if (not params or not _parameters_only(model)
            or any(name not in index or index[name][1] != tuple(p.shape) for name, p in params)):
        return None

    def parts(name: str, p: torch.nn.Parameter):
        rows = p.shape[0] if p.dim() > 1 else 1
        step = max(1, CHUNK_BYTES // max(1, p.numel() // rows * 4))
        for start in range(0, rows, step):
            # opened for this part alone: the file's pages it read leave the resident set on close
            with safe_open(str(index[name][0]), framework="pt") as f:
                yield f.get_tensor(name) if rows == 1 else f.get_slice(name)[start:start + step]

    return ((name, p, parts(name, p)) for name, p in params)


def _parameters_only(model: torch.nn.Module) -> bool:
    """Whether loading the model's parameters is the whole of `from_pretrained`'s work: no saved
    buffers (DeepSeek-V3's router bias is one), no modules kept in fp32 whatever the dtype, no
    quantization."""
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    saved_buffers = [key for key in model.state_dict() if key not in tied]
    return (not saved_buffers and not getattr(model, "_keep_in_fp32_modules", None)
            and not getattr(model, "_keep_in_fp32_modules_strict", None)
            and getattr(model.config, "quantization_config", None) is None)


def skeleton(directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    """`directory`'s model in `dtype` with parameters allocated but not initialised (untouched
    pages cost no memory), tied as `from_pretrained` ties them, its generation config loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(str(directory))
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.tie_weights()
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    return model


def load_streamed(directory: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, str] | None:
    """(model, fingerprint) of `directory` loaded in `dtype` one tensor at a time, or None where
    its files are not one safetensors tensor per parameter."""
    if not any(directory.glob("*.safetensors")):
        return None
    model = skeleton(directory, dtype)
    tensors = read_parameters(model, directory)
    if tensors is None:
        return None
    cached = cached_fingerprint(directory)
    fingerprint = _read(model, tensors, copy=True, hashing=cached is None) or cached
    if cached is None:
        cache_fingerprint(directory, fingerprint)
    return model, fingerprint


def _read(model: torch.nn.Module, tensors, copy: bool, hashing: bool = True) -> str | None:
    """One pass over `read_parameters`: each part copied into its parameter (`copy`: one rounding
    into the model's dtype) and hashed for the fingerprint (`hashing`), which is returned."""
    h = hasher(model.config) if hashing else None
    with torch.no_grad():
        for name, p, parts in tensors:
            if h is not None:
                hash_tensor(h, name, tuple(p.shape))
            row = 0
            for part in parts:
                if h is not None:
                    hash_values(h, part)
                if copy:
                    (p if p.dim() < 2 else p[row:row + part.shape[0]]).copy_(part)
                row += part.shape[0] if p.dim() >= 2 else 0
    return None if h is None else h.hexdigest()[:16]


def directory_fingerprint(directory: str | Path) -> str:
    """`model_fingerprint` of the model a Hugging Face directory loads, from its safetensors files
    (one tensor at a time, no model's weights in memory) and cached; a directory whose files do
    not name every parameter (another checkpoint layout) is loaded in fp32 and hashed instead."""
    directory = Path(directory).resolve()
    fingerprint = cached_fingerprint(directory)
    if fingerprint is not None:
        return fingerprint
    with torch.device("meta"):  # names, order and shapes only
        model = skeleton(directory, torch.float32)
    tensors = read_parameters(model, directory)
    if tensors is None:
        from transformers import AutoModelForCausalLM

        fingerprint = model_fingerprint(AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32))
    else:
        fingerprint = _read(model, tensors, copy=False)
    cache_fingerprint(directory, fingerprint)
    return fingerprint
