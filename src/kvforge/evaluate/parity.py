"""`kvforge eval exact`: the exact engine against transformers on real held-out prompts.

For each prompt: the largest logit difference over every prompt position, and whether greedy
decoding (up to `max_new_tokens`, or EOS) gives the same tokens as transformers' own `generate`.
In a low precision both engines are also measured against transformers in fp32 (a copy of the
same weights): what a user gives up to bf16 in each, so our difference to transformers' bf16
reads against the size of bf16's own rounding.
"""

from __future__ import annotations

import copy
import itertools

import torch

from kvforge.data.sharegpt import conversations
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig
from kvforge.prompting import encode_prompt


def parity_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` held-out first user turns of 200–2000 characters (the turn itself, so
    no prompt is a one-word greeting), as chat prompts when the model has a template."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    turns = (conv.turns[0][1] for conv in conversations("held_out") if conv.turns[0][0] == "user")
    chosen = itertools.islice((t for t in turns if 200 <= len(t) <= 2000), count)
    return [encode_prompt(tokenizer, text, chat=chat) for text in chosen]


def eval_parity(engine: Engine, prompts: int = 5, max_new_tokens: int = 64, progress=None) -> dict:
    hf = engine.model.hf
    hf32 = copy.deepcopy(hf).float() if engine.dtype != torch.float32 else None
    rows = []
    for i, ids in enumerate(parity_prompts(engine.model.tokenizer, prompts)):
        if progress:
            progress(f"prompt {i + 1}/{prompts}: {len(ids)} tokens")
        x = torch.tensor([ids], device=engine.device)
        ours_logits, _ = engine.prefill(x, logits="all")
        with torch.inference_mode():
            hf_logits = hf(x).logits.float()
            fp32_logits = hf32(x).logits if hf32 is not None else None
            hf_tokens = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=hf.generation_config.pad_token_id or 0,
            )[0, len(ids) :].tolist()
        ours_tokens = engine.generate(ids, GenerationConfig(max_new_tokens=max_new_tokens))[0].token_ids
        diverge = next((t for t, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b), None)
        rows.append(
            {
                "tokens": len(ids),
                "method": "exact",
                "max_abs_logit_diff": float((ours_logits - hf_logits).abs().max()),
                **({} if fp32_logits is None else {
                    "max_abs_logit_diff_vs_fp32": float((ours_logits.float() - fp32_logits).abs().max()),
                    "transformers_diff_vs_fp32": float((hf_logits - fp32_logits).abs().max()),
                }),
                "greedy_identical": ours_tokens == hf_tokens,
                "first_divergence": diverge,
                "divergence_gap": None if diverge is None else _top2_gap(hf, ids + hf_tokens[:diverge]),
            }
        )
    identical = sum(r["greedy_identical"] for r in rows)
    return {
        "command": "eval exact",
        "model": engine.model.name,
        "method": "exact",
        "tokens": [r["tokens"] for r in rows],
        "max_new_tokens": max_new_tokens,
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        **({} if hf32 is None else {
            "max_abs_logit_diff_vs_fp32": max(r["max_abs_logit_diff_vs_fp32"] for r in rows),
            "transformers_diff_vs_fp32": max(r["transformers_diff_vs_fp32"] for r in rows),
        }),
        "greedy_identical": identical,
        "greedy_identical_pct": 100.0 * identical / len(rows),
        # Where the two greedy paths part, how far transformers' own best token was ahead of its
        # second: a divergence at a gap of a rounding step is a near-tie, not a wrong engine.
        "max_divergence_gap": max((r["divergence_gap"] for r in rows if r["divergence_gap"] is not None), default=None),
        "results": rows,
    }


@torch.inference_mode()
def _top2_gap(hf, ids: list[int]) -> float:
    """transformers' logit margin between its top two next tokens after `ids`."""
    logits = hf(torch.tensor([ids], device=hf.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])
