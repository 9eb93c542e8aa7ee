"""RidgeFill with a decode-time rescue: when the text being decoded repeats an n-gram of the
prompt, the filled rows after each earlier occurrence (what a copy reads next) are recomputed
through the late layers before the next token. A lever for RidgeFill's key-token gap, measured
here to choose its setting among three (the engine's `fill.rescue` runs the chosen one): quality as
`kvforge eval ridgefill` measures it (same held-out prompts, teacher forced), one JSON object on the
last line. An implementation of its own, kept as a cross-check: `eval ridgefill` with the chosen
setting (the default `RescueConfig`) gives the same figures (2K: all-token +0.8 %, key +3.1 %).
It differs from the engine in one detail: it may rescue before the prompt's last token, which
generation prefills with the prompt (a gain for one token of 128).

Causal: the rescue before scoring token t+1 looks only at tokens up to t. A rescued row is
recomputed, not copied from the exact cache: its exact split-layer state runs layers
[split, L) attending to the cache as it stands (filled rows and all), as the prefill's anchors
do. A real decoder would keep the split-layer state of the filled rows (E numbers per row) and
pay, per rescued row, a late-layer row of prefill; the report counts those rows.

    python benchmarks/ridgefill_decode_rescue.py --maps MAPS [--model smollm2-135m] [--tokens 2048] [--samples 12]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvforge.artifacts import find_artifact
from kvforge.cache import KVCache, LayerCache
from kvforge.data.prompts import token_sequences
from kvforge import provenance
from kvforge.engine import Engine
from kvforge.evaluate.metrics import mean_nll, paired_bootstrap_ci, ppl_gap_pct, token_classes
from kvforge.fill.maps import RidgeMaps
from kvforge.fill.ridgefill import preset, ridgefill_plan
from kvforge.models import load_model
from kvforge.plan import final_depth
from kvforge.scoring import continuation_logits, continuation_nll, token_nll

# (n-gram length that triggers, rows rescued after each earlier occurrence, most recent occurrences used)
SETTINGS = [(2, 16, 4), (2, 32, 8), (3, 32, 8)]


def split_states(engine: Engine, prompt: list[int], split: int) -> torch.Tensor:
    """(1, P, E) the exact residual stream entering layer `split` for every prompt row."""
    cache = engine.new_cache(1, capacity=len(prompt))
    positions = torch.arange(len(prompt)).view(1, -1)
    return engine.run_layers(engine.adapter.embed(torch.tensor([prompt])), positions, cache, 0, split)


def recompute_rows(engine: Engine, cache: KVCache, rows: list[int], states: torch.Tensor, split: int) -> None:
    """Rows `rows` (prompt positions, sorted) of layers [split, L) rewritten in place: their exact
    split-layer states run the late layers, each row attending to the cache's rows before it (and
    the recomputed rows before it) as they stand."""
    index = torch.tensor(rows)
    others = torch.ones(rows[-1] + 1, dtype=torch.bool)
    others[index] = False
    keep = others.nonzero().flatten()
    layers = []
    for layer_index, layer in enumerate(cache.layers):
        if layer_index < split:
            layers.append(layer)  # not run
            continue
        sub = LayerCache(layer.k[:, :, keep].clone(), layer.v[:, :, keep].clone(), layer.positions[:, keep].clone(),
                         layer.kinds[:, keep].clone(), length=keep.numel())
        sub.contiguous = False  # attention masks by position: row r sees rows <= r
        layers.append(sub)
    scratch = KVCache(layers)
    engine.run_layers(states[:, index], index.view(1, -1), scratch, split)
    for layer_index in range(split, len(cache.layers)):
        sub, layer = scratch.layers[layer_index], cache.layers[layer_index]
        layer.k[:, :, index] = sub.k[:, :, sub.length - len(rows) : sub.length]
        layer.v[:, :, index] = sub.v[:, :, sub.length - len(rows) : sub.length]
        layer.kinds[:, index] = sub.kinds[:, sub.length - len(rows) : sub.length]


def rescued_nll(engine: Engine, seq: list[int], prompt_tokens: int, cache: KVCache, filled: torch.Tensor, states: torch.Tensor,
                split: int, n: int, window: int, recent: int) -> tuple[torch.Tensor, int, int]:
    """(T,) nats of seq[prompt_tokens:] over `cache` (changed in place), rescuing rows as decoding
    reaches each n-gram repeat; also (rows rescued, rescue events)."""
    rows_in_prompt = filled.numel()
    occurrences: dict[tuple[int, ...], list[int]] = {}
    for end in range(n - 1, rows_in_prompt - 1):  # an occurrence ending at `end` is followed by row end + 1
        occurrences.setdefault(tuple(seq[end - n + 1 : end + 1]), []).append(end)
    rescued = torch.zeros(rows_in_prompt, dtype=torch.bool)
    parts, start, events = [], prompt_tokens - 1, 0
    for t in range(prompt_tokens - 1, len(seq) - 1):  # the row of token t predicts token t + 1
        rows = set()
        for end in occurrences.get(tuple(seq[t - n + 1 : t + 1]), [])[-recent:]:
            rows.update(r for r in range(end + 1, min(end + 1 + window, rows_in_prompt)) if filled[r] and not rescued[r])
        if not rows:
            continue
        if t > start:
            parts.append(continuation_logits(engine, seq[: t + 1], start + 1, cache))
            start = t
        recompute_rows(engine, cache, sorted(rows), states, split)
        rescued[sorted(rows)] = True
        events += 1
    parts.append(continuation_logits(engine, seq, start + 1, cache))
    return token_nll(torch.cat(parts), seq[prompt_tokens:]), int(rescued.sum()), events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--maps", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(load_model(args.model))
    maps = RidgeMaps.load(args.maps or find_artifact("maps", args.model))
    maps.check_model(args.model, engine.model.fingerprint, engine.num_layers)
    config = preset("fast", engine.num_layers)
    arms = ["ridgefill", *[f"rescue n{n} w{w} r{r}" for n, w, r in SETTINGS]]
    nll: dict[str, list[torch.Tensor]] = {name: [] for name in ["exact", *arms]}
    counts: dict[str, list[tuple[int, int]]] = {name: [] for name in arms[1:]}
    novel, key, filled_rows = [], [], []
    sequences = token_sequences(engine.model.tokenizer, args.tokens + args.continuation, "held_out")
    with torch.inference_mode():
        for i in range(args.samples):
            seq = next(sequences)
            prompt = seq[: args.tokens - 1]
            _, exact = engine.prefill([prompt])
            _, filled_cache = engine.prefill([prompt], plan=ridgefill_plan(engine, prompt, config, maps))
            filled = final_depth(filled_cache, len(prompt)) < engine.num_layers
            positions = filled_cache.layers[-1].row_positions()[0]
            assert torch.equal(positions[: len(prompt)], torch.arange(len(prompt))), "rescue assumes row p at index p"
            states = split_states(engine, prompt, config.split)
            nll["exact"].append(continuation_nll(engine, seq, args.tokens, exact))
            nll["ridgefill"].append(continuation_nll(engine, seq, args.tokens, KVCache([layer.select_batch(torch.arange(1)) for layer in filled_cache.layers])))
            for (n, w, r), name in zip(SETTINGS, arms[1:]):
                cache = KVCache([layer.select_batch(torch.arange(1)) for layer in filled_cache.layers])
                values, rows, events = rescued_nll(engine, seq, args.tokens, cache, filled, states, config.split, n, w, r)
                nll[name].append(values)
                counts[name].append((rows, events))
            nov, k = token_classes(seq, args.tokens, filled)
            novel.append(nov)
            key.append(k)
            filled_rows.append(int(filled.sum()))
            print(f"sample {i + 1}/{args.samples}: " + ", ".join(f"{a} {float(nll[a][-1].mean()):.4f}" for a in nll)
                  + " | rescued " + ", ".join(f"{counts[a][-1][0]}" for a in counts), file=sys.stderr, flush=True)
    every = [torch.ones_like(m) for m in novel]
    rows = []
    for name in arms:
        row = {"arm": name, "filled_rows_mean": sum(filled_rows) / len(filled_rows)}
        for label, masks in (("novel", novel), ("all", every), ("key", key)):
            row[f"ppl_gap_{label}_pct"] = ppl_gap_pct(nll[name], nll["exact"], masks)
            row[f"ppl_gap_{label}_ci"] = paired_bootstrap_ci(nll[name], nll["exact"], masks)
        if name in counts:
            row["rescued_rows_mean"] = sum(c[0] for c in counts[name]) / len(counts[name])
            row["rescue_events_mean"] = sum(c[1] for c in counts[name]) / len(counts[name])
            row["rescued_share_of_filled"] = sum(c[0] for c in counts[name]) / sum(filled_rows)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(json.dumps(provenance.report({"command": "ridgefill_decode_rescue", "model": args.model, "method": "ridgefill", "tokens": args.tokens,
                      "continuation": args.continuation, "samples": args.samples, "split": config.split, "tail": config.tail,
                      "attended_rows": config.attended_rows, "maps": str(args.maps), "exact_all_nll": mean_nll(nll["exact"], every),
                      "novel_tokens": int(sum(int(m.sum()) for m in novel)), "key_tokens": int(sum(int(m.sum()) for m in key)),
                      "results": rows})))


if __name__ == "__main__":
    main()
