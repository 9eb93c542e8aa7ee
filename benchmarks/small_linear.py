"""A bf16 step's linears at small and chunk widths: kvforge's small-row kernel against oneDNN.

The 121 weights of smollm2-135m's decode step (30 layers of q/k/v, o, gate/up and down
projections; random values of the real shapes) are cycled through, as decoding does, so the
weights stream from memory: the milliseconds one step's linears cost for 1 to 1024 rows (decode,
verification, a batch's verification, prefill chunks) through `kernels.small_linear` (on AMX
tiles where the CPU has them, else AVX-512), oneDNN's prepacked linear and `F.linear` (what a
prefill runs). Run it with `KVFORGE_AMX=0` too for the AVX-512 rows on an AMX machine. Medians of
`--runs`, arms interleaved. Writes benchmarks/results/small-linear-<kernels>-<threads>t.json and
prints a Markdown table.

    python benchmarks/small_linear.py [--rows 1,2,9,16,32,64,144,256,512,1024] [--runs 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.ops import kernels
from kvforge import provenance

# smollm2-135m: fused q/k/v (576 + 2 x 192 outputs), o, fused gate/up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,9,16,32,64,144,256,512,1024")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.threads < 1:
        raise SystemExit(f"small_linear.py: --threads {args.threads} must be at least 1")
    torch.set_num_threads(args.threads)
    if kernels.kind() == "none":
        raise SystemExit("small_linear.py: the compiled kernels are not available here (no AVX512-BF16 or no C compiler)")
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=g) * 0.02).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    pairs = [[kernels.pack_pairs(w) for w in layer] for layer in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in layer] for layer in weights]
    arms = {
        "small_linear": lambda x, layer, i: kernels.small_linear(x, pairs[layer][i]),
        "onednn_packed": lambda x, layer, i: torch.ops.mkldnn._linear_pointwise(x, onednn[layer][i], None, "none", [], ""),
        "F.linear": lambda x, layer, i: F.linear(x, weights[layer][i]),
    }
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {k: torch.randn(rows, k, generator=g).bfloat16() for _, k in SHAPES}
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(args.runs + 1):  # the first round warms up; arms interleaved
            for arm, run in arms.items():
                start = time.perf_counter()
                for layer in range(LAYERS):
                    for i, (_, k) in enumerate(SHAPES):
                        run(inputs[k], layer, i)
                times[arm].append((time.perf_counter() - start) * 1e3)
        results.append({"rows": rows, **{f"{arm}_ms": statistics.median(t[1:]) for arm, t in times.items()}})
    report = {"kernels": kernels.kind(), "threads": args.threads, "torch": torch.__version__, "runs": args.runs, "results": results}
    out = Path(__file__).parent / "results" / f"small-linear-{report['kernels']}-{args.threads}t.json"
    out.write_text(json.dumps(provenance.report(report), indent=1) + "\n")
    one = results[0]
    print(f"kernels: {report['kernels']}, {args.threads} threads (ms for one step's 121 linears; x = over the first row count's small_linear)")
    print("| rows | small_linear | oneDNN packed | F.linear |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['small_linear_ms']:.1f} ({r['small_linear_ms'] / one['small_linear_ms']:.2f}x) "
              f"| {r['onednn_packed_ms']:.1f} | {r['F.linear_ms']:.1f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
