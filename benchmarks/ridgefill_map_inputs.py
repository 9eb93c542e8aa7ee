"""Which map inputs RidgeFill's ridge maps should read (smollm2-135m, split 15, fast rows).

    python benchmarks/ridgefill_map_inputs.py fit --tokens 100000       # moments of every candidate input
    python benchmarks/ridgefill_map_inputs.py eval --variants prev,next   # each variant's continuation gaps

`fit` accumulates the moments of x = [h15 row t, h15 row t-1, h15 row t+1] -> the inputs of layers
16..29 once; `eval` solves each variant (a subset of those blocks; `prev_rN`: the previous row
through an output-aware rank-N basis) and fills the fast preset's rows with it on held-out prompts,
continuation gaps to exact as `kvforge eval ridgefill` computes them. Earlier runs recorded in
benchmarks/results/ridgefill-map-inputs-smollm2-135m.json swapped `features` for layer 10's state,
the embeddings (this row's, the previous row's), layer 8's previous row and the row two back."""
import argparse, json, sys, time
from dataclasses import replace
import torch
from kvforge import ridge
from kvforge.data.prompts import token_sequences
from kvforge import provenance
from kvforge.engine import Engine
from kvforge.models import load_model
from kvforge.fill.calibrate import layer_inputs
from kvforge.fill.maps import RidgeMaps
from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan
from kvforge.evaluate.metrics import mean_nll, paired_bootstrap_ci, ppl_gap_pct, token_classes
from kvforge.evaluate.ridgefill import _filled_rows
from kvforge.scoring import continuation_nll
from kvforge.artifacts import find_artifact

S, EARLY, SINKS = 15, 10, 4
ap = argparse.ArgumentParser()
ap.add_argument("phase")
ap.add_argument("--tokens", type=int, default=100_000)
ap.add_argument("--prompt-tokens", type=int, default=2048)
ap.add_argument("--samples", type=int, default=8)
ap.add_argument("--moments", default="ridgefill-map-inputs-moments.pt")
ap.add_argument("--variants", default="base,prev,prev2,early,prev_early")
args = ap.parse_args()
torch.set_num_threads(2)
engine = Engine(load_model("smollm2-135m"))
L, E = engine.num_layers, engine.adapter.hidden_size

def shift(h, k): return torch.cat([h[:k], h[:-k]])
def features(inputs):
    h = inputs[S]
    nxt = torch.cat([h[1:], h[-1:]])
    return torch.cat([h, shift(h, 1), nxt], dim=-1)

BLOCKS = {"base": [0], "prev": [0, 1], "next": [0, 2], "prev_next": [0, 1, 2], "prev_r64": [0, 1], "prev_r128": [0, 1], "prev_r32": [0, 1]}

if args.phase == "fit":
    NB = 3
    fit = ridge.Moments.zeros(NB * E, (L - 1 - S) * E); held = ridge.Moments.zeros(NB * E, (L - 1 - S) * E)
    rows = count = 0; t0 = time.time()
    for ids in token_sequences(engine.model.tokenizer, 2048, "fit"):
        inputs = layer_inputs(engine, ids, L)
        x = features(inputs)[SINKS:]
        y = torch.cat([inputs[l][SINKS:] for l in range(S + 1, L)], dim=-1)
        (held if count % 10 == 9 else fit).update(x, y)
        count += 1; rows += len(ids) - SINKS
        print(f"{count} seqs {rows} rows {time.time()-t0:.0f}s", file=sys.stderr, flush=True)
        if rows >= args.tokens: break
    torch.save({"fit": fit.__dict__, "held": held.__dict__}, args.moments)
    sys.exit()

m = torch.load(args.moments)
fit, held = ridge.Moments(**m["fit"]), ridge.Moments(**m["held"])
late = list(range(S + 1, L))
outs = torch.arange(fit.xy.shape[1])
solved = {}
def transform(m, T):
    return ridge.Moments(m.n, T.T @ m.sx, m.sy, T.T @ m.xx @ T, T.T @ m.xy, m.yy)
for name in args.variants.split(","):
    cols = torch.cat([torch.arange(b * E, (b + 1) * E) for b in BLOCKS[name]])
    f, hd = fit.select(cols, outs), held.select(cols, outs)
    if "_r" in name:
        r = int(name.split("_r")[1])
        full = ridge.pick_lambda(f, hd, ridge.LAMBDAS, groups=len(late))
        _, _, cxx, _ = f.centred()
        cpp = cxx[E:, E:]
        ev, evec = torch.linalg.eigh(cpp)
        root = evec @ torch.diag(ev.clamp(min=1e-12).sqrt()) @ evec.T
        inv_root = evec @ torch.diag(ev.clamp(min=1e-12).rsqrt()) @ evec.T
        U, _sv, _vt = torch.linalg.svd(root @ full.w[E:], full_matrices=False)
        P = inv_root @ U[:, :r]  # (E, r): prev -> r features
        T = torch.zeros(2 * E, E + r, dtype=torch.float64); T[:E, :E] = torch.eye(E, dtype=torch.float64); T[E:, E:] = P
        ch = ridge.pick_lambda(transform(f, T), transform(hd, T), ridge.LAMBDAS, groups=len(late))
        solved[name] = ((T @ ch.w).float(), ch.b.float())
    else:
        ch = ridge.pick_lambda(f, hd, ridge.LAMBDAS, groups=len(late))
        solved[name] = (ch.w.float(), ch.b.float())
    print(name, "r2", [round(r, 4) for r in ch.r2], "lam", ch.lam, file=sys.stderr, flush=True)

maps = RidgeMaps.load(find_artifact("maps", "smollm2-135m"))
config = RidgeFillConfig(split=S, tail=256, attended_rows=16)

class Fill:
    def __init__(self, name, x_all):
        self.w, self.b = solved[name]; self.x = x_all[:, torch.cat([torch.arange(b * E, (b + 1) * E) for b in BLOCKS[name]])]
    def __call__(self, layer, h, rows):
        if layer == S: return h[:, rows]
        i = late.index(layer)
        w, b = self.w[:, i * E:(i + 1) * E], self.b[i * E:(i + 1) * E]
        return (self.x[rows] @ w + b).to(h.dtype).unsqueeze(0)

names = args.variants.split(",")
nll = {n: [] for n in ["exact", *names]}; novel, key = [], []
seqs = token_sequences(engine.model.tokenizer, args.prompt_tokens + 128, "held_out")
for i in range(args.samples):
    seq = next(seqs); prompt = seq[: args.prompt_tokens - 1]
    with torch.inference_mode():
        x_all = features(layer_inputs(engine, prompt, S + 1)).float()
    base_plan = ridgefill_plan(engine, prompt, config, maps)
    caches = {"exact": engine.prefill([prompt])[1]}
    for n in names:
        caches[n] = engine.prefill([prompt], plan=replace(base_plan, fill=Fill(n, x_all)))[1]
    with torch.inference_mode():
        for n, c in caches.items():
            nll[n].append(continuation_nll(engine, seq, args.prompt_tokens, c).cpu())
    filled = _filled_rows(caches[names[0]], len(prompt))
    a, k = token_classes(seq, args.prompt_tokens, filled); novel.append(a); key.append(k)
    print(f"sample {i+1}", {n: round(float(nll[n][-1].mean()), 4) for n in nll}, file=sys.stderr, flush=True)
every = [torch.ones_like(x) for x in novel]
res = {}
for n in names:
    res[n] = {c: (round(ppl_gap_pct(nll[n], nll["exact"], msk), 2), [round(v, 2) for v in paired_bootstrap_ci(nll[n], nll["exact"], msk)])
              for c, msk in (("novel", novel), ("all", every), ("key", key))}
print(json.dumps(provenance.report({"prompt_tokens": args.prompt_tokens, "samples": args.samples, "novel": int(sum(x.sum() for x in novel)), "key": int(sum(x.sum() for x in key)), "results": res})))
