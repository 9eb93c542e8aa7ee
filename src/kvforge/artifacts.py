"""Where fitted artifacts live unless a path is given: one place for every kind.

    maps        $KVFORGE_HOME/maps/<model>-ridgefill.safetensors            (RidgeFill)
    adapter     $KVFORGE_HOME/adapters/<model>-speed-cut<C>.safetensors     (SPEED LoRA)
    translator  $KVFORGE_HOME/translators/<source>-to-<target>.safetensors  (KV-Lingo)

`kvforge fit ...` writes there by default; the CLI, the server and the demo look there.
"""

from __future__ import annotations

from pathlib import Path

from kvforge.paths import kvforge_home, safe_name

KINDS = ("maps", "adapter", "translator")


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
    """The translator a command uses for the pair when given none: the stage-2 one when it
    exists (adapted beats closed form: docs/lingo.md), else the stage-1 one."""
    adapted = translator_stage2_path(source, target)
    return adapted if adapted.is_file() else artifact_path("translator", source, target=target)

