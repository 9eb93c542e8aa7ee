"""What running a translator's maps in bf16 costs in quality. Since the maps run in the target
cache's dtype (`Translator.in_dtype`), a bf16 hand-off rounds each weight to bf16 (each matmul
still accumulates in fp32; its output and the bias sum are bf16). This scores, in bf16 engines, on `kvforge eval lingo`'s held-out samples, the
same translator twice: its maps in bf16 (what a bf16 hand-off runs) and kept in float32 (what it
ran before), each against the target's own bf16 cache; and times both translating the source's
cache of a held-out text of `--tokens` target tokens (`translate_cache`: reading the source rows
back, the maps, writing the target's layers; 1 thread, arms interleaved, median of 3). One JSON
object on the last line.

    python benchmarks/lingo_bf16_maps.py --translator T [--samples 24] [--tokens 4096] [--native-tail 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from kvforge.bench.harness import interleaved_medians
from kvforge.bench.lingo import text_of_tokens
from kvforge.engine import Engine
from kvforge.evaluate.lingo import LingoEvalSettings, eval_lingo
from kvforge.models import load_model
from kvforge.translate.align import align, tokenize
from kvforge.translate.handoff import translate_cache
from kvforge.translate.translator import Translator
from kvforge import provenance


class Float32Maps(Translator):
    """The same maps, never cast: they run in float32 whatever the cache's dtype."""

    def in_dtype(self, dtype: torch.dtype) -> Translator:
        return self


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--translator", required=True)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--native-tail", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=4096, help="target tokens of the timed text")
    parser.add_argument("--threads", type=int, default=2, help="threads of the quality half (the timing runs on 1)")
    args = parser.parse_args()
    translator = Translator.load(args.translator)
    fields = {f.name: getattr(translator, f.name) for f in dataclasses.fields(Translator) if f.init}
    float32_maps = Float32Maps(**fields)
    source = Engine(load_model(translator.source.name, dtype=torch.bfloat16))
    target = Engine(load_model(translator.target.name, dtype=torch.bfloat16))

    torch.set_num_threads(1)
    text = text_of_tokens(target.model.tokenizer, args.tokens)
    src, tgt = tokenize(source.model.tokenizer, text), tokenize(target.model.tokenizer, text)
    _, src_cache = source.prefill([src.ids], logits="none")
    alignment = align(src, tgt, translator.align).truncate(len(tgt.ids) - 1)
    seconds = interleaved_medians({
        label: (lambda maps=maps: translate_cache(maps, source, target, src_cache, alignment, tgt.ids, args.native_tail))
        for label, maps in (("bf16_maps", translator), ("float32_maps", float32_maps))
    })
    print(f"translating {len(tgt.ids)} target tokens: bf16 maps {seconds['bf16_maps']:.3f} s, float32 maps {seconds['float32_maps']:.3f} s")

    torch.set_num_threads(args.threads)
    settings = LingoEvalSettings(samples=args.samples, native_tail=args.native_tail)
    report = eval_lingo(translator, source, target, settings, compare={"float32 maps": float32_maps})
    fp32 = report["compare"]["float32 maps"]
    native = report["bpb_target_native"]
    result = {
        "translator": args.translator, "dtype": "bfloat16", "samples": report["samples"], "native_tail": args.native_tail,
        "tokens_timed": len(tgt.ids), "bpb_target_native": native,
        "bf16_maps": {"bpb": report["bpb_target_translated"], "bpb_ci": report["bpb_ci"]["target_translated"], "kl": report["kl"],
                      "gap_pct": 100 * (report["bpb_target_translated"] / native - 1)},
        "float32_maps": {"bpb": fp32["bpb"], "bpb_ci": fp32["bpb_ci"], "kl": fp32["kl"], "gap_pct": 100 * (fp32["bpb"] / native - 1)},
    }
    for arm in ("bf16_maps", "float32_maps"):
        result[arm]["translate_s"] = seconds[arm]
        r = result[arm]
        print(f"{arm:13s} bits per byte {r['bpb']:.4f} ({r['gap_pct']:+.1f} % over the target's own {native:.4f}), KL {r['kl']:.4f}")
    print(json.dumps(provenance.report(result)))


if __name__ == "__main__":
    main()
