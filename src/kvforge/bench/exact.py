"""`kvforge bench exact`: the exact engine against transformers' own model on the same weights.

Per prompt length: prefill time (last-position logits only, for both), greedy decode speed over
`decode_tokens` steps from that prefilled cache, KV bytes, and the largest logit difference
between kvforge and transformers over every position of that prompt (a separate, untimed
prefill of each that keeps all T × V logits; the last position's difference is reported too).
The transformers arms use its sdpa attention and its own `DynamicCache`, called the way
`generate` calls the model.
"""

from __future__ import annotations

import torch

from kvforge.bench.harness import environment, interleaved_medians, timed
from kvforge.data.prompts import held_out_text_tokens
from kvforge.engine import Engine


def expected_kv_bytes(engine: Engine, tokens: int) -> int:
    """What a prefill of `tokens` rows should hold, from the config alone: an attention layer's
    K/V rows (an MLA layer: its rope key and latent), a recurrent layer's conv and fp32 state, twice
    (the state before the prefill is kept for its rollback)."""
    a, width = engine.adapter, torch.finfo(engine.dtype).bits // 8
    total = 0
    for layer in range(a.num_layers):
        if a.is_recurrent(layer):
            channels, history, (heads, key_dim, value_dim) = a.state_spec(layer)
            total += 2 * (channels * history * width + heads * key_dim * value_dim * 4)
        else:
            heads, key_dim, value_dim = a.cache_dims(layer)
            total += heads * (key_dim + value_dim) * tokens * width
    return total


def bench_exact(engine: Engine, lengths: list[int], runs: int = 3, decode_tokens: int = 64, progress=None) -> dict:
    hf = engine.model.hf
    results = []
    for tokens in lengths:
        if tokens + decode_tokens >= engine.model.context_length:
            raise ValueError(f"{tokens} + {decode_tokens} tokens exceed the context of {engine.model.context_length}")
        ids = torch.tensor([held_out_text_tokens(engine.model.tokenizer, tokens)], device=engine.device)
        if progress:
            progress(f"{tokens} tokens: parity")
        ours_logits, cache = engine.prefill(ids, logits="all")  # (1, T, V), untimed
        diff = _logit_diff(ours_logits, hf_prefill(hf, ids, logits_to_keep=0)[1].logits)
        del ours_logits

        if progress:
            progress(f"{tokens} tokens: prefill x{runs}")
        prefill = interleaved_medians(
            {"ours": lambda: engine.prefill(ids), "hf": lambda: hf_prefill(hf, ids)}, runs=runs
        )
        if progress:
            progress(f"{tokens} tokens: decode {decode_tokens} x{runs}")
        decode = interleaved_medians(
            {"ours": lambda: ours_decode(engine, ids, decode_tokens), "hf": lambda: hf_decode(hf, ids, decode_tokens)},
            runs=runs,
        )
        ours_tps, hf_tps = decode_tokens / decode["ours"], decode_tokens / decode["hf"]
        results.append(
            {
                "tokens": tokens,
                "method": "exact",
                "prefill_s": prefill["ours"],
                "hf_prefill_s": prefill["hf"],
                "prefill_speedup_vs_hf": prefill["hf"] / prefill["ours"],
                "prefill_tokens_per_s": tokens / prefill["ours"],
                "decode_tokens_per_s": ours_tps,
                "hf_decode_tokens_per_s": hf_tps,
                "decode_speedup_vs_hf": ours_tps / hf_tps,
                "kv_bytes": cache.nbytes,
                "kv_bytes_expected": expected_kv_bytes(engine, tokens),
                "max_abs_logit_diff": diff["all"],  # over all prompt positions
                "max_abs_logit_diff_last": diff["last"],
            }
        )
    return {
        "command": "bench exact",
        "model": engine.model.name,
        "method": "exact",
        "tokens": lengths,
        "runs": runs,
        "decode_tokens": decode_tokens,
        **environment(engine),
        "results": results,
    }


def hf_prefill(hf, ids, logits_to_keep: int = 1):
    """transformers' prefill as `generate` runs it: its DynamicCache, last-position logits
    (logits_to_keep=0: every position's)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        return cache, hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)


def _logit_diff(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    """Largest |kvforge - transformers| logit over every position ('all') and at the last one
    ('last'); ours (B, T, V) fp32 is overwritten. The parity prefill holds both (T, V) tensors:
    1.6 GB for a 49K vocabulary at 4096 tokens."""
    if ours.shape != theirs.shape:
        raise ValueError(f"logits of shape {tuple(ours.shape)} vs transformers' {tuple(theirs.shape)}")
    with torch.inference_mode():
        ours.sub_(theirs.float()).abs_()  # in place: no third (T, V) tensor
        return {"all": float(ours.max()), "last": float(ours[:, -1].max())}


def ours_decode(engine: Engine, ids: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` greedy decode steps after a prefill (the prefill is not timed)."""
    logits, cache = engine.prefill(ids)
    token = logits.argmax(-1)
    positions = torch.tensor([ids.shape[1]], device=engine.device)

    def loop():
        nonlocal token, positions
        for _ in range(steps):
            logits = engine.decode_step(token, cache, positions)
            token, positions = logits.argmax(-1), positions + 1

    return timed(loop)[0]


def hf_decode(hf, ids: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` greedy decode steps of transformers' model after its prefill (not timed)."""
    with torch.inference_mode():
        cache, out = hf_prefill(hf, ids)
        token = out.logits[:, -1].argmax(-1, keepdim=True)

        def loop():
            nonlocal token
            for _ in range(steps):  # the cache grows in place
                out = hf(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)

        return timed(loop)[0]
