"""`kvforge bench load`: what loading a model costs in memory and time, each dtype in a fresh process.

The child process imports torch and transformers, reads its resident set (the baseline), loads the
model through `load_model`, takes its fingerprint, then reads its peak resident set (Linux's
VmHWM): the peak above the baseline is what loading itself held at its worst, against the bytes of
the weights it loaded. A fresh process per dtype keeps one load's freed pages out of the next's.
Then it decodes: a 512-token prompt and 8 tokens, its resident set read after (`rss_decoding`:
the weights' packed copies made by then), and again after `Engine.release_unpacked_weights` and
the same decoding (`rss_decoding_released`: what `serve` and `rollout` hold).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD = r"""
import json, sys, time
import torch, transformers


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


spec, dtype, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
from pathlib import Path  # noqa: E402

from kvforge.models.fingerprint import cached_fingerprint  # noqa: E402
from kvforge.models.loading import _resolve, load_model  # noqa: E402

directory = Path(_resolve(spec)[0])
cached = directory.is_dir() and cached_fingerprint(directory) is not None  # else the load's own pass hashes the files
base = status("VmRSS")
if dtype == "tokenizer":
    transformers.AutoTokenizer.from_pretrained(str(directory))
    print(json.dumps({"peak_above_import_bytes": status("VmHWM") - base}))
    sys.exit(0)
start = time.perf_counter()
loaded = load_model(spec, dtype=dtype)
load_s = time.perf_counter() - start
start = time.perf_counter()
fingerprint = loaded.fingerprint
fingerprint_s = time.perf_counter() - start
params = list(loaded.hf.parameters())  # tied ones once
row = {"dtype": str(loaded.dtype).removeprefix("torch."), "parameters": sum(p.numel() for p in params),
       "weight_bytes": sum(p.numel() * p.element_size() for p in params), "baseline_rss_bytes": base, "peak_above_import_bytes": status("VmHWM") - base,
       "rss_after_bytes": status("VmRSS") - base, "load_s": load_s, "fingerprint_s": fingerprint_s, "fingerprint": fingerprint,
       "fingerprint_was_cached": cached}
from kvforge.engine import Engine  # noqa: E402
from kvforge.generation import GenerationConfig  # noqa: E402

engine = Engine(loaded)
length = min(512, getattr(loaded.hf.config, "max_position_embeddings", 512) - 16)  # a tiny test model's context is shorter
prompt = [[(7919 * i) % (loaded.hf.config.vocab_size - 10) + 5 for i in range(length)]]
engine.generate(prompt, GenerationConfig(max_new_tokens=8))  # a prefill and decode steps: the packed copies exist now
row["rss_decoding_bytes"] = status("VmRSS") - base
row["released_bytes"] = engine.release_unpacked_weights()  # as `serve` and `rollout` do
engine.generate(prompt, GenerationConfig(max_new_tokens=8))
row["rss_decoding_released_bytes"] = status("VmRSS") - base
print(json.dumps(row))
"""


def measure_load(spec: str, dtype: str, threads: int) -> dict:
    """One load of `spec` in `dtype` in a fresh process: its peak resident memory above `import
    torch, transformers`, the weights' bytes, and the load and fingerprint times."""
    if not os.path.exists("/proc/self/status"):
        raise ValueError("bench load reads /proc/self/status: Linux only")
    row = _child(spec, dtype, threads)
    row["peak_over_weights"] = row["peak_above_import_bytes"] / row["weight_bytes"]
    for key in ("rss_decoding", "rss_decoding_released"):
        row[f"{key}_over_weights"] = row[f"{key}_bytes"] / row["weight_bytes"]
    return row


def _child(spec: str, mode: str, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, spec, mode, str(threads)], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise ValueError(f"loading {spec} ({mode}) failed: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_load(spec: str, dtypes: list[str], threads: int, progress=None) -> dict:
    """`measure_load` per dtype, and the tokenizer's own peak (part of every load's, whatever the
    dtype: the figure to set aside when comparing a load's peak with its weights)."""
    say = progress or (lambda message: None)
    results = []
    for dtype in dtypes:
        say(f"loading {spec} in {dtype}")
        results.append(measure_load(spec, dtype, threads))
    tokenizer = _child(spec, "tokenizer", threads)["peak_above_import_bytes"]
    for row in results:
        row["tokenizer_peak_bytes"] = tokenizer
        row["peak_without_tokenizer_over_weights"] = (row["peak_above_import_bytes"] - tokenizer) / row["weight_bytes"]
    return {"command": "bench load", "model": spec, "threads": threads, "results": results}
