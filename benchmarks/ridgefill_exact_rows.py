"""RidgeFill at long prompts: which exact-row budget (tail, tail-attended anchors, the rows after
each) buys quality, at what MAC ceiling. Quality as `kvforge eval ridgefill` measures it, the exact
arm shared across settings; one JSON object on the last line.

    python benchmarks/ridgefill_exact_rows.py [--model smollm2-135m] [--tokens 4096] [--samples 8] [--maps MAPS]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvforge.artifacts import find_artifact
from kvforge.flops import exact_macs, prefill_macs
from kvforge.data.prompts import held_out_text_tokens
from kvforge import provenance
from kvforge.engine import Engine
from kvforge.evaluate.ridgefill import EvalSettings, eval_ridgefill, summary
from kvforge.fill.maps import RidgeMaps
from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan
from kvforge.models import load_model
from kvforge.plan import final_depth

# (tail, anchors, rows kept after each anchor); the fast preset is (256, 16, 16)
SETTINGS = [(256, 32, 16), (256, 64, 8), (128, 48, 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--maps", type=Path, default=None)
    ap.add_argument("--split", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(load_model(args.model))
    maps = RidgeMaps.load(args.maps or find_artifact("maps", args.model))
    maps.check_model(args.model, engine.model.fingerprint, engine.num_layers)
    settings = EvalSettings(samples=args.samples, needles=0, prompt_tokens=args.tokens)
    prompt = held_out_text_tokens(engine.model.tokenizer, args.tokens)  # the bench prompt: its MAC ceiling
    memo: dict = {}
    rows = []
    for tail, anchors, span in SETTINGS:
        config = RidgeFillConfig(split=args.split, tail=tail, attended_rows=anchors, attended_span=span)
        _, cache = engine.prefill([prompt], plan=ridgefill_plan(engine, prompt, config, maps))
        depth = final_depth(cache, len(prompt))
        report = eval_ridgefill(engine, maps, config, settings, memo=memo, progress=lambda m: print(m, file=sys.stderr))
        out = summary(report, args.model, config, args.tokens)
        row = {
            "tokens": args.tokens, "arm": f"tail {tail}, {anchors} anchors x {span}", "tail": tail, "attended_rows": anchors, "attended_span": span,
            "filled_share": float((depth < engine.num_layers).float().mean()),
            "ceiling": exact_macs(engine.adapter, len(prompt)) / prefill_macs(engine.adapter, depth, args.split, True, len(maps.inputs), maps.predicts_normed),
            **{k: out[k] for k in ("ppl_gap_novel_pct", "ppl_gap_novel_ci", "ppl_gap_all_pct", "ppl_gap_all_ci", "ppl_gap_key_pct")},
        }
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    print(json.dumps(provenance.report({"command": "ridgefill_exact_rows", "model": args.model, "method": "ridgefill", "tokens": args.tokens, "split": args.split,
                      "samples": args.samples, "results": rows})))


if __name__ == "__main__":
    main()
