"""Projection weights kept only packed, as `kvforge serve` and `kvforge rollout` keep them: prefill
and decode time against an engine that keeps the unpacked weights too.

Two engines over one model, loaded twice in bf16: one keeps each projection weight beside the
packed pairs `small_linear` reads, the other only the pairs (`Engine.release_unpacked_weights`):
its prefills unpack each weight for the call. The arms run interleaved: a prefill of each length
(its last-token logits compared bit for bit), the same prefill in chunks of --chunk tokens as the
server runs it (each chunk longer than `kernels.small_rows` unpacks every weight again), and
greedy decoding after it (the tokens compared).
Medians of `--runs`. Writes benchmarks/results/released-weights-<model>-<kernels>-<threads>t.json
and prints a Markdown table. The resident memory each keeps is `kvforge bench load`'s figure.

    python benchmarks/released_weights.py [--model smollm2-135m] [--tokens 256,1024,4096] [--chunk 512] [--decode-tokens 32] [--runs 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvforge import provenance
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig
from kvforge.models import load_model
from kvforge.ops import kernels
from kvforge.steps import run_to_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", default="256,1024,4096")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (the server's --max-num-batched-tokens default)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if min(args.threads, args.runs, args.decode_tokens, args.chunk) < 1:
        raise SystemExit("released_weights.py: --threads, --runs, --chunk and --decode-tokens must be at least 1")
    if kernels.kind() == "none":
        raise SystemExit("released_weights.py: the compiled kernels are not available here, so no weight is kept packed")
    torch.set_num_threads(args.threads)
    arms = {"kept": Engine(load_model(args.model, dtype="bf16")), "released": Engine(load_model(args.model, dtype="bf16"))}
    vocab = arms["kept"].model.hf.config.vocab_size
    config = GenerationConfig(max_new_tokens=args.decode_tokens, ignore_eos=True)
    arms["released"].generate([[5, 6, 7]], config)  # packs every weight, so the release below has pairs to keep
    released_bytes = arms["released"].release_unpacked_weights()
    results = []
    for length in [int(t) for t in args.tokens.split(",")]:
        prompt = [(7919 * i) % (vocab - 10) + 5 for i in range(length)]
        prefill: dict[str, list[float]] = {arm: [] for arm in arms}
        chunked: dict[str, list[float]] = {arm: [] for arm in arms}
        decode: dict[str, list[float]] = {arm: [] for arm in arms}
        logits, tokens = {}, {}
        for run in range(args.runs + 1):  # the first round warms up
            for arm, engine in arms.items():
                start = time.perf_counter()
                logits[arm] = engine.prefill([prompt])[0]
                seconds = time.perf_counter() - start
                start = time.perf_counter()
                run_to_end(engine.prefill_steps([prompt], chunk_size=args.chunk))
                chunk_seconds = time.perf_counter() - start
                generation = engine.generate([prompt], config)[0]
                tokens[arm] = generation.token_ids
                if run:
                    prefill[arm].append(seconds)
                    chunked[arm].append(chunk_seconds)
                    decode[arm].append(generation.decode_s / max(1, len(generation.token_ids) - 1))
        row = {"tokens": length, "logits_equal": bool(torch.equal(logits["kept"], logits["released"])),
               "tokens_equal": tokens["kept"] == tokens["released"]}
        for arm in arms:
            row[f"{arm}_prefill_s"] = statistics.median(prefill[arm])
            row[f"{arm}_chunked_prefill_s"] = statistics.median(chunked[arm])
            row[f"{arm}_decode_ms_per_token"] = 1e3 * statistics.median(decode[arm])
        row["prefill_released_over_kept"] = row["released_prefill_s"] / row["kept_prefill_s"]
        row["chunked_prefill_released_over_kept"] = row["released_chunked_prefill_s"] / row["kept_chunked_prefill_s"]
        row["decode_released_over_kept"] = row["released_decode_ms_per_token"] / row["kept_decode_ms_per_token"]
        results.append(row)
    report = {"command": "python benchmarks/released_weights.py", "model": args.model, "threads": args.threads, "dtype": "bfloat16",
              "kernels": kernels.kind(), "runs": args.runs, "chunk": args.chunk, "decode_tokens": args.decode_tokens, "released_bytes": released_bytes,
              "results": results}
    out = Path(__file__).parent / "results" / f"released-weights-{args.model}-{report['kernels']}-{args.threads}t.json"
    out.write_text(json.dumps(provenance.report(report)) + "\n")
    print(f"{args.model}, kernels {report['kernels']}, {args.threads} threads: {released_bytes / 1e6:.0f} MB of unpacked weights released")
    print(f"| tokens | prefill kept / released (s) | released over kept | in chunks of {args.chunk}: released over kept "
          "| decode kept / released (ms per token) | released over kept | same logits, tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['tokens']} | {r['kept_prefill_s']:.3f} / {r['released_prefill_s']:.3f} | {r['prefill_released_over_kept']:.3f}x "
              f"| {r['chunked_prefill_released_over_kept']:.3f}x "
              f"| {r['kept_decode_ms_per_token']:.1f} / {r['released_decode_ms_per_token']:.1f} | {r['decode_released_over_kept']:.3f}x "
              f"| {r['logits_equal']}, {r['tokens_equal']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
