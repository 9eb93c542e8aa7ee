"""Packaged data: ShareGPT conversations (streamed) and the prompts built from them."""
