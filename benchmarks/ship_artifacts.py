"""Copy a fitted artifact into the repository's `artifacts/` folder and record it in MANIFEST.json.

    python benchmarks/ship_artifacts.py maps $KVFORGE_HOME/maps/smollm2-135m-ridgefill.safetensors \
        --fit-json benchmarks/results/artifact-fit-maps-smollm2-135m.json \
        --eval-json benchmarks/results/artifact-eval-maps-smollm2-135m.json \
        --command "kvforge fit ridgefill --model smollm2-135m --int8 --threads 2 --json"

The manifest entry holds what a reader needs to trust the file: the model fingerprints it was
fitted for, its size and sha256, the command that fitted it, the fit's JSON, and its held-out
score read from the eval JSON (never typed in). A translator may be stored in bf16
(`--storage bf16`): it is then evaluated as shipped, so the score is the bf16 file's. Artifacts
derived from Gemma carry Gemma's terms-of-use notice.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "artifacts"
FOLDERS = {"maps": "maps", "adapter": "adapters", "translator": "translators"}
GEMMA_NOTICE = ("Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms; "
                "this artifact was derived from Gemma-3-270M's activations (see artifacts/NOTICE).")


def held_out(kind: str, report: dict) -> dict:
    """The headline quality cost an eval JSON holds for this kind of artifact."""
    if kind == "maps":
        lo, hi = report["ppl_gap_all_ci"]
        return {"figure": f"all-token perplexity gap vs exact at {report['tokens']} tokens (rescue on)",
                "value": f"{report['ppl_gap_all_pct']:+.1f} % [{lo:+.1f}, {hi:+.1f}]",
                "also": {"novel_pct": report["ppl_gap_novel_pct"], "key_pct": report["ppl_gap_key_pct"],
                         "needles_pct": report.get("needle_ridgefill"), "needles_exact_pct": report.get("needle_exact")}}
    if kind == "adapter":
        lo, hi = report["policy_gap_ci"]["adapted"]
        return {"figure": f"reply perplexity gap vs full depth on {report['samples']} replies",
                "value": f"{report['policy_gap_pct']['adapted']:+.1f} % [{lo:+.1f}, {hi:+.1f}]",
                "also": {"training_free_pct": report["policy_gap_pct"]["training_free"], "needles": report.get("needle")}}
    if kind == "translator":
        native, translated = report["bpb_target_native"], report["bpb_target_translated"]
        qa = report.get("qa", {}).get("correct", {})
        return {"figure": f"bits per byte vs the target's own cache on {report['samples']} held-out texts",
                "value": f"{translated:.3f} vs {native:.3f} ({100 * (translated / native - 1):+.1f} %)",
                "also": {"facts_recalled": qa.get("translated"), "facts_recalled_own_cache": qa.get("target_native"),
                         "questions": report.get("qa", {}).get("questions")}}
    raise ValueError(kind)


def models_of(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    if "source" in meta:  # a translator
        source, target = json.loads(meta["source"]), json.loads(meta["target"])
        return {"source": source["name"], "source_fingerprint": source["fingerprint"],
                "target": target["name"], "target_fingerprint": target["fingerprint"]}
    return {"model": meta["model"], "fingerprint": meta.get("model_fingerprint", meta.get("fingerprint"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(FOLDERS))
    parser.add_argument("file", type=Path)
    parser.add_argument("--fit-json", type=Path, required=True)
    parser.add_argument("--eval-json", type=Path, required=True)
    parser.add_argument("--command", required=True, help="The command that fitted it.")
    parser.add_argument("--eval-command", required=True, help="The command that scored it.")
    parser.add_argument("--name", help="File name in artifacts/<kind>/ (default: the file's own).")
    parser.add_argument("--splits", help="Maps: ship only these splits, comma-separated (the same tensors, a smaller file).")
    args = parser.parse_args()
    for path in (args.file, args.fit_json, args.eval_json):
        if not path.is_file():
            sys.exit(f"error: {path} does not exist")
    report = json.loads(args.eval_json.read_text().strip().splitlines()[-1])
    fit = json.loads(args.fit_json.read_text().strip().splitlines()[-1])
    dest = SHIPPED / FOLDERS[args.kind] / (args.name or args.file.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if args.splits:
        from kvforge.fill.maps import RidgeMaps

        RidgeMaps.load(args.file).only([int(x) for x in args.splits.split(",")]).save(dest)
    elif args.file.resolve() != dest.resolve():
        shutil.copyfile(args.file, dest)
    models = models_of(dest)
    entry = {
        "file": str(dest.relative_to(SHIPPED)),
        "kind": args.kind,
        **models,
        "bytes": dest.stat().st_size,
        "sha256": hashlib.sha256(dest.read_bytes()).hexdigest(),
        "command": args.command + (f" (shipped: split {args.splits} of its file)" if args.splits else ""),
        "fit_json": str(args.fit_json.resolve().relative_to(ROOT)),
        "fitted_on": fit.get("machine", {}).get("cpu"),
        "eval_command": args.eval_command,
        "eval_json": str(args.eval_json.resolve().relative_to(ROOT)),
        "held_out": held_out(args.kind, report),
    }
    if "gemma" in json.dumps(models).lower():
        entry["notice"] = GEMMA_NOTICE
    manifest_path = SHIPPED / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"artifacts": []}
    manifest["artifacts"] = [e for e in manifest["artifacts"] if e["file"] != entry["file"]] + [entry]
    manifest["artifacts"].sort(key=lambda e: e["file"])
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(entry, indent=1))


if __name__ == "__main__":
    main()
