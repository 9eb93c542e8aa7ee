"""Speculative decoding: drafters, lossless verification, the (accept length, bonus token) prefetcher, rollouts."""
