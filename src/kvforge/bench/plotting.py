"""Benchmark figures: a headless matplotlib figure in, a PNG out."""

from __future__ import annotations

from pathlib import Path


def new_figure(columns: int = 1, figsize: tuple[float, float] = (6, 4)):
    """(figure, axes) drawn off screen (no display on CI machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, columns, figsize=figsize)


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
