"""kvforge: forge KV caches instead of computing them in full."""
__version__ = "0.1.0"
