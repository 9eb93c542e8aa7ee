"""Starting vLLM the way kvforge's benches and tests do: in this process, eager, same threads.

In-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the proposer's counters and the in-memory cache
store are this process's objects, and several engines can be kept side by side so benchmark arms
interleave. Eager (`enforce_eager=True`): vLLM's torch.compile warm-up costs minutes on two cores
and kvforge's engine does not compile either. Threads: vLLM's CPU worker binds its OpenMP threads
to cores (`VLLM_CPU_OMP_THREADS_BIND`); kvforge binds as many as torch has. Connector: every engine
kvforge starts carries kvforge's connector (in-memory store; requests that name no cache are
untouched), because vLLM keeps one process-global worker-side connector: once one engine in the
process has a connector, an engine without one fails its first step.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvforge.vllm import kv_transfer_config

VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm not installed (pip install 'kvforge[vllm]')"
    try:
        import vllm  # noqa: F401  (the import is the check)
    except Exception as exc:  # a broken install: callers record it and go on without vLLM
        return f"vllm import failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return None


def start_llm(model_dir: str | Path, dtype: torch.dtype | str = torch.float32, max_model_len: int = 4096, **kwargs):
    """vLLM's offline `LLM` over a Hugging Face directory, in this process, eager, prefix caching
    off (a forged block must never be reused as exact), `kwargs` passed on (speculative_config,
    kv_transfer_config, max_num_seqs, ...)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    n = torch.get_num_threads()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if n == 1 else f"0-{n - 1}")
    from vllm import LLM

    dtype = VLLM_DTYPES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    # the KV cache sized explicitly: by default vLLM-cpu reserves 92 % of the machine's memory per
    # engine, and kvforge keeps several engines in one process
    from kvforge.vllm.weights import WORKER_EXTENSION

    settings = dict(enforce_eager=True, enable_prefix_caching=False, max_model_len=max_model_len, seed=0,
                    kv_cache_memory_bytes=1 << 30, kv_transfer_config=kv_transfer_config("memory"),
                    worker_extension_cls=WORKER_EXTENSION)  # weight updates by name (`vllm.weights`)
    settings.update(kwargs)
    return LLM(model=str(model_dir), dtype=dtype, **settings)


def generate(llm, prompts: list[list[int]], params) -> list:
    """`llm.generate` on token-id prompts; `params` one SamplingParams or one per prompt."""
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)


def close_llm(llm) -> None:
    """Stop vLLM's engine core now rather than at exit, so the next engine has the memory."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def spec_counters(llm) -> dict[str, float]:
    """This engine's speculative-decoding counters so far (drafts, draft tokens, accepted tokens);
    needs `disable_log_stats=False`. Read off the engine's own Prometheus logger, not the global
    registry: each in-process engine start unregisters the metrics of an engine started before."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    manager = getattr(llm.llm_engine, "logger_manager", None)
    for logger in getattr(manager, "stat_loggers", ()):
        prom = getattr(logger, "spec_decoding_prom", None)
        if prom is None:
            continue
        for key in out:
            per_engine = getattr(prom, f"counter_spec_decode_num_{key}", {})  # absent without speculation
            out[key] += sum(child._value.get() for child in per_engine.values())
    return out
