"""Where fitted artifacts live unless a path is given: one place for every kind.

    maps        $KVFORGE_HOME/maps/<model>-ridgefill.safetensors            (RidgeFill)
    adapter     $KVFORGE_HOME/adapters/<model>-speed-cut<C>.safetensors     (SPEED LoRA)
    translator  $KVFORGE_HOME/translators/<source>-to-<target>.safetensors  (KV-Lingo)

`kvforge fit ...` writes there by default (`artifact_path`); the CLI, the server and the demo read
with `find_artifact`: the user's own fit there, else the copy of the same name shipped for the
packaged models in the repository's `artifacts/` folder (`$KVFORGE_ARTIFACTS` points elsewhere).
Nothing ever writes into the shipped folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvforge.paths import kvforge_home, safe_name

KINDS = ("maps", "adapter", "translator")


def shipped_dir() -> Path:
    """The folder of artifacts shipped with kvforge: `$KVFORGE_ARTIFACTS`, default the checkout's `artifacts/`."""
    default = Path(__file__).resolve().parents[2] / "artifacts"
    return Path(os.environ.get("KVFORGE_ARTIFACTS", default))


def shipped_manifest() -> dict[str, dict]:
    """The shipped artifacts' manifest (`artifacts/MANIFEST.json`), by file name: for each, the model
    fingerprint, the command that fitted it, its held-out scores and their JSON; {} when none."""
    path = shipped_dir() / "MANIFEST.json"
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())["artifacts"]
    except (OSError, ValueError, KeyError):
        return {}
    return {Path(entry["file"]).name: entry for entry in entries}


def shipped_copy(path: Path) -> Path | None:
    """The shipped artifact standing in for `path` (a default path under $KVFORGE_HOME), if any."""
    try:
        rel = path.relative_to(kvforge_home())
    except ValueError:
        return None
    copy = shipped_dir() / rel
    return copy if copy.is_file() else None


def readable(path: Path) -> Path:
    """`path` when a fit left a file there (the user's own fit wins), else the shipped copy of the
    same name when there is one, else `path` (missing: the caller says how to fit it)."""
    return path if path.is_file() else shipped_copy(path) or path


def find_artifact(kind: str, model: str, *, cut: int | None = None, target: str | None = None) -> Path:
    """The `kind` artifact a command reads for `model` when given no path (`readable` of `artifact_path`)."""
    return readable(artifact_path(kind, model, cut=cut, target=target))


def artifact_path(kind: str, model: str, *, cut: int | None = None, target: str | None = None) -> Path:
    """The default path of a `kind` artifact for `model`: an adapter needs the SPEED `cut` it was
    trained for, a translator its `target` model (`model` is then the source)."""
    if kind == "maps":
        return kvforge_home() / "maps" / f"{safe_name(model)}-ridgefill.safetensors"
    if kind == "adapter":
        if cut is None:
            raise ValueError("an adapter's default path needs its SPEED cut")
        return kvforge_home() / "adapters" / f"{safe_name(model)}-speed-cut{cut}.safetensors"
    if kind == "translator":
        if target is None:
            raise ValueError("a translator's default path needs its target model")
        return kvforge_home() / "translators" / f"{safe_name(model)}-to-{safe_name(target)}.safetensors"
    raise ValueError(f"unknown artifact kind {kind!r}: use {', '.join(KINDS)}")


def translator_stage2_path(source: str, target: str) -> Path:
    """Where `kvforge fit lingo --stage 2` writes by default: beside the stage-1 translator."""
    stage1 = artifact_path("translator", source, target=target)
    return stage1.with_name(f"{stage1.stem}-stage2.safetensors")


def default_translator_path(source: str, target: str) -> Path:
    """The translator a command uses for the pair when given none: the user's own fit before a
    shipped one, and within each the stage-2 one before stage 1 (adapted beats closed form:
    docs/lingo.md); the stage-1 path, where a fit goes, when there is none."""
    stage2, stage1 = translator_stage2_path(source, target), artifact_path("translator", source, target=target)
    for path in (stage2, stage1, shipped_copy(stage2), shipped_copy(stage1)):
        if path is not None and path.is_file():
            return path
    return stage1

