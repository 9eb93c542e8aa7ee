"""Drafting gate settings replayed offline: tokens committed per step on the copy prompts.

Greedy decoding commits the same tokens whatever is drafted, so one plain greedy run of `bench
ngram`'s copy prompts fixes every step's outcome: a draft is accepted up to its first token that
differs from the plain output. This replays the n-gram drafter (and prompt lookup) through a
gate setting and counts steps: tokens per step, and how many steps verified a draft. No timing:
which setting pays on a machine follows from its verification cost (`bench peers`' verify_9).
Writes benchmarks/results/gate-replay-<model>.json and prints a Markdown table.

    python benchmarks/gate_replay.py [--model smollm2-135m] [--dtype bf16] [--k 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvforge.bench.ngram import copy_prompts
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig
from kvforge.models import load_model
from kvforge.speculative.ngram import NgramCache, NgramDrafter, PromptLookupDrafter
from kvforge.speculative.step import DraftConfig, DraftGate
from kvforge import provenance

# (label, gate): None drafts every step
SETTINGS = [
    ("no gate", None),
    ("retry 8 (the earlier default)", dict(retry=8, max_retry=8)),
    ("retry 4, doubling to 64", dict(retry=4, max_retry=64)),
    ("retry 2, doubling to 64 (the default)", dict(retry=2, max_retry=64)),
]


def replay(prompts: list[list[int]], outputs: list[list[int]], make_drafter, gate: DraftGate | None, k: int) -> dict:
    steps = drafted_steps = 0
    for key, (prompt, out) in enumerate(zip(prompts, outputs)):
        drafter, context, i = make_drafter(prompt), list(prompt), 0
        while i < len(out):
            draft = drafter.propose(context, k) if gate is None or gate.allows(key) else []
            accepted = 0
            while accepted < len(draft) and i + accepted < len(out) and draft[accepted] == out[i + accepted]:
                accepted += 1
            if gate is not None:
                gate.record(key, len(draft), accepted)
            committed = out[i : i + accepted + 1]
            drafter.observe(committed)
            context += committed
            i += len(committed)
            steps += 1
            drafted_steps += bool(draft)
    tokens = sum(len(o) for o in outputs)
    return {"tokens": tokens, "steps": steps, "drafted_steps": drafted_steps, "tokens_per_step": tokens / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    engine = Engine(load_model(args.model, dtype=args.dtype))
    prompts = copy_prompts(engine.model.tokenizer)
    outputs = [engine.generate(p, GenerationConfig(max_new_tokens=128))[0].token_ids for p in prompts]
    config = DraftConfig()
    drafters = {
        "ngram": lambda p: NgramDrafter(NgramCache(p, config.n_min, config.n_max), p),
        "prompt-lookup": lambda p: PromptLookupDrafter(config.n_min, config.n_max),
    }
    rows = []
    for label, gate in SETTINGS:
        for name, make in drafters.items():
            result = replay(prompts, outputs, make, None if gate is None else DraftGate(**gate), args.k)
            rows.append({"gate": label, "drafter": name, **(gate or {}), **result})
    report = {"model": args.model, "dtype": str(engine.dtype), "k": args.k, "prompts": len(prompts), "results": rows}
    path = Path("benchmarks/results") / f"gate-replay-{args.model}.json"
    path.write_text(json.dumps(provenance.report(report), indent=1))
    print("| gate | drafter | tokens per step | steps | steps that verified a draft |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gate']} | {r['drafter']} | {r['tokens_per_step']:.2f} | {r['steps']} | {r['drafted_steps']} |")
    print(f"\n{path}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
