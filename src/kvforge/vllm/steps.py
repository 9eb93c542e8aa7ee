"""What kvforge's vLLM model classes (RidgeFill, SPEED) need of vLLM's steps: engine settings under
which a prompt's first step holds the whole prompt, the check that an engine runs with them, and
the attention metadata of the step being run.

Both classes plan a prompt from all of its rows at once, so chunked prefill is off and a step's
token budget holds the longest prompt; prefix caching is off (a block's rows depend on its
prompt's plan, so it must never be reused as another prompt's). RidgeFill runs eager, its path
Python over data-dependent row sets; SPEED's steps whose every row runs every layer are vLLM's own
model, so a SPEED engine may compile.
"""

from __future__ import annotations

from kvforge.errors import KvforgeError


def whole_prompt_engine_args(max_model_len: int, compiled: bool = False) -> dict:
    """`vllm.LLM` settings: each prompt prefilled whole in one step, no prefix caching, eager
    unless `compiled` (a class whose compiled steps are vLLM's own model)."""
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max_model_len,
        "max_model_len": max_model_len,
        "enable_prefix_caching": False,
        "enforce_eager": not compiled,
    }


def check_whole_prompt_engine(vllm_config, method: str, helper: str, compiles: bool = False) -> None:
    """Refuse an engine without `whole_prompt_engine_args`' settings, naming `helper`, the function
    that sets them; `compiles`: the class runs under vLLM's compilation too."""
    scheduler = vllm_config.scheduler_config
    if scheduler.enable_chunked_prefill or scheduler.max_num_batched_tokens < vllm_config.model_config.max_model_len:
        raise KvforgeError(f"{method} in vLLM plans each prompt from its whole first step: set enable_chunked_prefill=False and "
                           f"max_num_batched_tokens >= max_model_len ({helper} does)")
    if not compiles and not vllm_config.model_config.enforce_eager:
        raise KvforgeError(f"{method} in vLLM runs eager: set enforce_eager=True ({helper} does)")
    if vllm_config.cache_config.enable_prefix_caching:
        raise KvforgeError(f"{method} in vLLM needs enable_prefix_caching=False: its blocks must never be reused as another prompt's")


def step_metadata():
    """The attention metadata of the forward being run (the target model's under speculative
    decoding; one KV cache group), or None (vLLM's warm-up and dummy runs)."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if not isinstance(metadata, dict) or not metadata:
        return None
    return next(iter(metadata.values()))
