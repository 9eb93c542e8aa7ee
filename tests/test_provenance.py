"""Every JSON report says where it ran and names no path of the machine that wrote it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvforge import provenance


def test_machine_names_the_cpu_its_class_flags_threads_versions_and_commit():
    m = provenance.machine()
    assert m["cpu"] and m["cores"] >= 1 and m["threads"] >= 1 and m["torch"]
    assert set(m["cpu_flags"]) == set(provenance.CPU_FLAGS) and m["cpu_class"] in ("AMX-BF16", "AVX512-BF16", "AVX2", "other")
    flags = {flag for flag, on in m["cpu_flags"].items() if on}
    assert m["cpu_class"] == ("AMX-BF16" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "AVX2" if "avx2" in flags else "other")
    assert m["commit"] is None or len(m["commit"].split("+")[0]) == 40


def test_paths_become_relative_to_the_repository_home_or_a_bare_name(monkeypatch, tmp_path):
    home = tmp_path / "kvf"
    monkeypatch.setenv("KVFORGE_HOME", str(home))
    repo = provenance.REPO_ROOT
    report = {
        "plot": f"{repo}/benchmarks/results/x.png",
        "translator": f"{home}/translators/a-to-b.safetensors",
        "command": f"kvforge bench lingo --translator {home}/t.safetensors --plot {repo}/p.png",
        "scratch": [f"{os.path.realpath('/tmp')}/abc/run.json"],
        "user": f"{Path.home()}/maps.safetensors",
        "kept": ["tok/s", "3/4", "http://127.0.0.1:8000/v1/models", "/dev/null"],
        "number": 3.5,
    }
    out = provenance.portable(report)
    assert out["plot"] == "benchmarks/results/x.png"
    assert out["translator"] == "$KVFORGE_HOME/translators/a-to-b.safetensors"
    assert out["command"] == "kvforge bench lingo --translator $KVFORGE_HOME/t.safetensors --plot p.png"
    assert out["scratch"] == ["run.json"] and out["user"] == "~/maps.safetensors"
    assert out["kept"] == report["kept"] and out["number"] == 3.5


def test_a_cli_json_report_carries_the_machine_and_no_absolute_path(capsys, tmp_path, monkeypatch):
    from kvforge.cli.common import emit_json

    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path))
    emit_json({"command": "bench x", "maps": str(tmp_path / "maps" / "m.safetensors")})
    line = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(line)
    assert report["maps"] == "$KVFORGE_HOME/maps/m.safetensors" and report["machine"]["cpu"]
    assert str(tmp_path) not in line
