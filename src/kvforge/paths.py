"""Where kvforge keeps its files, and model specs as file names. No torch here: the CLI's common
module and the data reader import it at start-up."""

from __future__ import annotations

import os
from pathlib import Path


def kvforge_home() -> Path:
    """$KVFORGE_HOME, default ~/.cache/kvforge: converted models, fitted artifacts, data caches."""
    return Path(os.environ.get("KVFORGE_HOME", Path.home() / ".cache" / "kvforge"))


def figure_name(model: str) -> str:
    """A model spec as the name part of a figure's default file: a directory or file spec by its own
    name (`~/models/llama-1b` -> `llama-1b`, not the whole path), an alias or hub id as `safe_name`."""
    path = Path(model).expanduser()
    if "/" in model and path.exists():
        return safe_name(path.stem if path.is_file() else path.name)
    return safe_name(model)


def safe_name(model: str) -> str:
    """A model spec (alias, path or hub id) as one file-name component."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
