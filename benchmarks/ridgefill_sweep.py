"""RidgeFill split/tail sweep: speed vs quality, so a user can pick a point.

For each setting: perplexity gap on novel, key and all tokens (held-out continuation), needle
accuracy overall and among needles wholly in filled rows (without the attended-row rescue: the
maps' own retrieval; exact answers are memoised by prompt and shared), then TTFT of every
setting and exact interleaved in one process at one prompt length, with the MAC ceiling. Writes
benchmarks/results/ridgefill-sweep-<model>.json and prints a Markdown table.

    python benchmarks/ridgefill_sweep.py --maps MAPS [--model smollm2-135m] [--tokens 4096] [--part quality|speed]

`--part quality` writes the quality rows alone (it can share the CPU with other quality jobs);
`--part speed` times the settings of that file later, on an idle machine, and completes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from kvforge.flops import exact_macs, prefill_macs
from kvforge.bench.harness import environment, interleaved_medians
from kvforge.data.prompts import held_out_text_tokens
from kvforge.engine import Engine
from kvforge.evaluate.ridgefill import EvalSettings, eval_ridgefill
from kvforge.fill.maps import RidgeMaps
from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan
from kvforge.models import load_model
from kvforge.plan import final_depth
from kvforge import provenance

# (split, tail, attended rows: anchors kept exact with the 16 rows after each)
SETTINGS = [(10, 256, 16), (15, 256, 0), (15, 256, 16), (15, 512, 32), (20, 256, 16), (20, 512, 32)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--maps", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--needles", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the quality part")
    ap.add_argument("--part", choices=["all", "quality", "speed"], default="all", help="run one half (speed reads the quality file)")
    ap.add_argument("--timing-threads", type=int, default=1, help="torch threads while timing (one was the stable setting here)")
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU), fp32, bf16 or fp16")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(load_model(args.model, dtype=args.dtype))
    maps = RidgeMaps.load(args.maps)
    maps.check_model(args.model, engine.model.fingerprint, engine.num_layers)
    configs = [RidgeFillConfig(split=s, tail=t, attended_rows=a) for s, t, a in SETTINGS if maps.has_split(s)]
    settings = EvalSettings(samples=args.samples, needles=args.needles)
    path = Path("benchmarks/results") / f"ridgefill-sweep-{args.model}.json"
    if args.part == "speed":
        rows = json.loads(path.read_text())["rows"]
        if [r["config"] for r in rows] != json.loads(json.dumps([asdict(c) for c in configs])):
            sys.exit(f"error: {path} holds other settings than this sweep; run --part quality first")
    else:
        memo: dict = {}
        rows = []
        for c in configs:
            print(f"quality: split {c.split}, tail {c.tail}, attended {c.attended_rows}", file=sys.stderr, flush=True)
            q = eval_ridgefill(engine, maps, c, settings, memo=memo)
            rows.append({"config": asdict(c), "quality": q})
    if args.part == "quality":
        write(path, {"model": args.model, "maps": str(args.maps), **environment(), "settings": asdict(settings), "rows": rows})
        return

    torch.set_num_threads(args.timing_threads)
    prompt = held_out_text_tokens(engine.model.tokenizer, args.tokens)
    arms = {"exact": lambda: engine.prefill([prompt])}
    for i, c in enumerate(configs):
        arms[str(i)] = lambda c=c: engine.prefill([prompt], plan=ridgefill_plan(engine, prompt, c, maps))
    print(f"speed: {len(arms)} arms at {args.tokens} tokens", file=sys.stderr, flush=True)
    times = interleaved_medians(arms, runs=args.runs)
    for i, (row, c) in enumerate(zip(rows, configs)):
        plan = ridgefill_plan(engine, prompt, c, maps)
        _, cache = engine.prefill([prompt], plan=plan)
        depth = final_depth(cache, len(prompt))
        row["speed"] = {
            "tokens": args.tokens,
            "speedup": times["exact"] / times[str(i)],
            "ceiling": exact_macs(engine.adapter, args.tokens) / prefill_macs(engine.adapter, depth, c.split, True, len(maps.inputs), maps.predicts_normed),
            "filled_fraction": float((depth < engine.num_layers).float().mean()),
        }
    write(path, {"model": args.model, "maps": str(args.maps), "exact_ttft_s": times["exact"], **environment(), "settings": asdict(settings), "rows": rows})
    print(f"| split | tail | attended rows | TTFT speedup @{args.tokens} (ceiling) | novel ppl gap [95 % CI] | all-token ppl gap [95 % CI] | key ppl gap | "
          "needle (exact) | needle in filled rows, no attended rows | identity novel gap | identity needle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        c, q, s = row["config"], row["quality"], row["speed"]
        r, ident, needle = q["arms"]["ridgefill"], q["arms"]["identity"], q["needle"]
        ci, ci_all = r["ppl_gap_novel_ci"], r["ppl_gap_all_ci"]
        unrescued = "ridgefill_no_attended"
        print(
            f"| {c['split']} | {c['tail']} | {c['attended_rows']} | {s['speedup']:.2f}× ({s['ceiling']:.2f}×) | "
            f"{r['ppl_gap_novel_pct']:+.1f} % [{ci[0]:+.1f}, {ci[1]:+.1f}] | {r['ppl_gap_all_pct']:+.1f} % [{ci_all[0]:+.1f}, {ci_all[1]:+.1f}] | "
            f"{r['ppl_gap_key_pct']:+.1f} % | {needle['ridgefill']:.0f} % ({needle['exact']:.0f} %) | "
            f"{needle['answered_in_filled'][unrescued]}/{needle['filled'][unrescued]} | {ident['ppl_gap_novel_pct']:+.1f} % | {needle['identity']:.0f} % |"
        )
    print(f"wrote {path}", file=sys.stderr)


def write(path: Path, out: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(provenance.report(out), indent=1, default=str))


if __name__ == "__main__":
    main()
