"""The `kvforge` command: importing each command module registers its commands on the apps in
`kvforge.cli.common`, in this order (the order `kvforge --help` lists them). No algorithm lives here."""

import os

# vLLM logs to stdout by default; a kvforge command's stdout carries its result (with --json, the
# JSON line alone), so vLLM's log goes to stderr whenever a command starts vLLM
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

from kvforge.cli import generate, exact, ridgefill, speed, ngram, rl, lingo, serve  # noqa: F401  (registers the commands)
from kvforge.cli import peers, vllm  # noqa: F401  (registers `bench peers`, `bench vllm-*`)
from kvforge.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    app()
