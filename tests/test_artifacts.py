"""Where artifacts are read and written, and the artifacts shipped for the packaged models.

Fast tests: the lookup order (a user's own fit in $KVFORGE_HOME before the shipped copy; for a
translator, stage 2 before stage 1 within each) and that nothing writes into the shipped folder.
Slow tests: every file in artifacts/MANIFEST.json is intact (size, sha256), loads against the
packaged weights it names, and the shipped RidgeFill maps predict held-out late-layer inputs as
well as a small refit does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from kvforge.artifacts import (
    artifact_path, default_translator_path, find_artifact, shipped_dir, shipped_manifest, translator_stage2_path,
)

SHIPPED = Path(__file__).resolve().parents[1] / "artifacts"


@pytest.fixture
def homes(tmp_path, monkeypatch):
    """An empty $KVFORGE_HOME and an empty shipped folder."""
    home, shipped = tmp_path / "home", tmp_path / "shipped"
    monkeypatch.setenv("KVFORGE_HOME", str(home))
    monkeypatch.setenv("KVFORGE_ARTIFACTS", str(shipped))
    return home, shipped


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def test_an_own_fit_wins_over_the_shipped_copy(homes):
    home, shipped = homes
    own = artifact_path("maps", "m")
    assert own.parent.parent == home and find_artifact("maps", "m") == own  # neither exists: where a fit goes
    copy = _touch(shipped / "maps" / own.name)
    assert find_artifact("maps", "m") == copy
    _touch(own)
    assert find_artifact("maps", "m") == own
    adapter = _touch(shipped / "adapters" / artifact_path("adapter", "m", cut=3).name)
    assert find_artifact("adapter", "m", cut=3) == adapter and find_artifact("adapter", "m", cut=4).parent.parent == home


def test_a_translator_is_the_own_stage_two_then_own_stage_one_then_shipped(homes):
    home, shipped = homes
    stage1, stage2 = artifact_path("translator", "a", target="b"), translator_stage2_path("a", "b")
    shipped1, shipped2 = shipped / "translators" / stage1.name, shipped / "translators" / stage2.name
    assert default_translator_path("a", "b") == stage1
    for path in (shipped1, shipped2, stage1, stage2):  # each added file outranks the ones before
        _touch(path)
        assert default_translator_path("a", "b") == path
    assert default_translator_path("b", "a") == artifact_path("translator", "b", target="a")  # per direction


def test_fits_write_under_kvforge_home_never_into_the_shipped_folder(homes):
    home, shipped = homes
    for kind, extra in (("maps", {}), ("adapter", {"cut": 2}), ("translator", {"target": "t"})):
        assert home in artifact_path(kind, "m", **extra).parents and shipped not in artifact_path(kind, "m", **extra).parents


def test_the_manifest_is_read_by_file_name_and_a_damaged_one_reads_as_empty(homes):
    _, shipped = homes
    assert shipped_manifest() == {}
    shipped.mkdir()
    (shipped / "MANIFEST.json").write_text(json.dumps({"artifacts": [{"file": "maps/m-ridgefill.safetensors", "kind": "maps"}]}))
    assert shipped_manifest() == {"m-ridgefill.safetensors": {"file": "maps/m-ridgefill.safetensors", "kind": "maps"}}
    (shipped / "MANIFEST.json").write_text("{not json")
    assert shipped_manifest() == {}


def test_the_shipped_folder_is_the_checkouts_artifacts_by_default(monkeypatch):
    monkeypatch.delenv("KVFORGE_ARTIFACTS", raising=False)
    assert shipped_dir() == SHIPPED


# --- the shipped artifacts themselves (packaged real models) ---------------------------------------

def _manifest() -> list[dict]:
    return json.loads((SHIPPED / "MANIFEST.json").read_text())["artifacts"]


def test_the_manifest_names_every_shipped_file_and_each_is_intact():
    entries = _manifest()
    files = {p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*.safetensors")}
    assert files == {e["file"] for e in entries} and {e["kind"] for e in entries} == {"maps", "adapter", "translator"}
    for entry in entries:
        data = (SHIPPED / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]
        assert entry["held_out"]["value"] and (SHIPPED.parent / entry["eval_json"]).is_file() and (SHIPPED.parent / entry["fit_json"]).is_file()
        derived_from_gemma = "gemma" in json.dumps({k: v for k, v in entry.items() if k.endswith(("model", "source", "target"))})
        assert ("notice" in entry) == derived_from_gemma, entry["file"]
    assert sum(e["bytes"] for e in entries) <= 80 * 2**20


@pytest.mark.slow
def test_every_shipped_artifact_loads_against_the_packaged_weights(real_model):
    from kvforge.engine import Engine
    from kvforge.fill.lora import LoraAdapter
    from kvforge.fill.maps import RidgeMaps
    from kvforge.models import load_model
    from kvforge.translate.translator import ModelSide, Translator

    engines = {"smollm2-135m": Engine(real_model)}
    for entry in _manifest():
        path = SHIPPED / entry["file"]
        if entry["kind"] == "maps":
            engine = engines[entry["model"]]
            RidgeMaps.load(path).check_model(entry["model"], engine.model.fingerprint, engine.num_layers)
        elif entry["kind"] == "adapter":
            engine = engines[entry["model"]]
            LoraAdapter.load(path).check_model(entry["model"], engine.model.fingerprint, engine.num_layers)
        else:
            for name in (entry["source"], entry["target"]):
                engines.setdefault(name, Engine(load_model(name, dtype="fp32")))
            Translator.load(path).check_pair(ModelSide.of(engines[entry["source"]]), ModelSide.of(engines[entry["target"]]))


def _r2(pred: torch.Tensor, y: torch.Tensor) -> float:
    """Variance-weighted R² pooled over a layer's features."""
    return float(1 - (y - pred).pow(2).sum() / (y - y.mean(0)).pow(2).sum())


@pytest.mark.slow
def test_the_shipped_ridgefill_maps_predict_held_out_text_as_well_as_a_fresh_refit(real_model):
    """Refit the fast split's maps on 10 short sequences and compare both with the exact late-layer
    inputs of held-out text: the shipped maps (200K calibration tokens) must predict every late layer
    at least as well as the refit (R² within 0.01; the small refit falls below zero at the deepest
    layers, the shipped maps do not), and at the first late layer, where even the small refit is
    accurate, the two must predict alike (relative difference <= 0.25; 0.17 measured)."""
    from kvforge.data.prompts import held_out_text_tokens
    from kvforge.engine import Engine
    from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill, layer_inputs
    from kvforge.fill.maps import RidgeMaps
    from kvforge.fill.ridgefill import preset_split

    engine = Engine(real_model)
    split = preset_split("fast", engine.num_layers)
    shipped = RidgeMaps.load(SHIPPED / "maps" / "smollm2-135m-ridgefill.safetensors")
    refit = fit_ridgefill(engine, CalibrationConfig((split,), tokens=10 * 512, seq_len=512), "smollm2-135m")
    inputs = layer_inputs(engine, held_out_text_tokens(engine.model.tokenizer, 1024), engine.num_layers)
    first = 4  # the sink rows stay exact and out of any fit
    x = torch.cat([inputs[split][first:], inputs[split][first - 1:-1]], dim=-1).float()
    for layer in range(split + 1, engine.num_layers):
        y = inputs[layer][first:].float()
        preds = {}
        for name, maps in (("shipped", shipped), ("refit", refit)):
            w, b = maps.weights(split, layer)
            preds[name] = x @ w + b
        shipped_r2, refit_r2 = _r2(preds["shipped"], y), _r2(preds["refit"], y)
        assert shipped_r2 >= refit_r2 - 0.01 and shipped_r2 > 0, (layer, shipped_r2, refit_r2)
        if layer == split + 1:
            assert (preds["shipped"] - preds["refit"]).norm() / y.norm() <= 0.25
