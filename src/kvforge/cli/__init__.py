"""The `kvforge` command: importing each command module registers its commands on the apps in
`kvforge.cli.common`, in this order (the order `kvforge --help` lists them). No algorithm lives here."""

from kvforge.cli import generate, exact, ridgefill, speed, ngram, rl, lingo, serve  # noqa: F401  (registers the commands)
from kvforge.cli import peers, vllm  # noqa: F401  (registers `bench peers`, `bench vllm-*`)
from kvforge.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    app()
