"""Where kvforge keeps its files, and model specs as file names. No torch here: the CLI's common
module and the data reader import it at start-up."""

from __future__ import annotations

import os
from pathlib import Path


def kvforge_home() -> Path:
    """$KVFORGE_HOME, default ~/.cache/kvforge: converted models, fitted artifacts, data caches."""
    return Path(os.environ.get("KVFORGE_HOME", Path.home() / ".cache" / "kvforge"))


def safe_name(model: str) -> str:
    """A model spec (alias, path or hub id) as one file-name component."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
