"""`bench rl`'s vLLM arms: the same rollouts inside vLLM, whose weights are updated between epochs
in place the way RL frameworks update them (`vllm.weights.update_vllm_weights`: vLLM's own reload,
post-load repacking included).

Arms, each a vLLM engine in this process (same dtype, same threads): `vllm-plain` (no
speculation), `vllm-drafted` (kvforge's proposer under its cost gate, for rows that finish
together: each row drafts from its prompt's previous rollouts first, then the n-grams) and `vllm-off` (the same proposer, never
drafting: the floor of vLLM's speculative path alone, which `vllm-drafted` should not fall below).
Each problem is one request with `n` = G samples at temperature 1.

vLLM samples with its own sampler, seeded per request (sample i of a request: seed + i); the seed
includes the epoch, so every epoch's samples are fresh draws whatever the noise mode of kvforge's
arms. Drafting changes how vLLM's sampler consumes its random numbers, so `vllm-drafted`'s samples
are draws from the same distributions as `vllm-plain`'s, not the same tokens.
"""

from __future__ import annotations

import time

from kvforge.speculative.step import SpecStats

VLLM_ARMS = ("vllm-plain", "vllm-drafted", "vllm-off")


class VllmRollouts:
    """One vLLM engine per arm over `model_dir`, kept for the whole run."""

    def __init__(self, model_dir, dtype, max_model_len: int, group: int, k: int, progress=None, prefetch: bool = False):
        from kvforge.vllm import speculative_config
        from kvforge.vllm.engine import start_llm
        from kvforge.vllm.proposer import LIVE

        self.engines, self.proposers = {}, {}
        for arm in VLLM_ARMS:
            if progress:
                progress(f"starting vLLM for arm {arm}")
            spec = None if arm == "vllm-plain" else speculative_config(k=k, gate=True, group=True, prefetch=prefetch, drafting=arm == "vllm-drafted")
            before = set(LIVE)
            self.engines[arm] = start_llm(model_dir, dtype, max_model_len, speculative_config=spec, max_num_seqs=max(group, 8))
            self.proposers[arm] = next(iter(set(LIVE) - before), None)

    def warm(self, prompt: list[int], group: int) -> None:
        """First-call costs out of the timings (a prompt kept out of the training problems, so no
        proposer keeps it among a training problem's rollouts)."""
        for arm in self.engines:
            self.roll_out(arm, [prompt], group, 4, seed=0)

    def roll_out(self, arm: str, encoded: list[list[int]], group: int, max_tokens: int, seed: int) -> dict:
        """One arm's pass over the problems, as `bench rl`'s kvforge arms report theirs."""
        from vllm import SamplingParams

        from kvforge.vllm.engine import generate

        proposer = self.proposers[arm]
        before = _proposer_counts(proposer)
        tokens, texts = [], []
        start = time.perf_counter()
        for index, prompt in enumerate(encoded):
            params = SamplingParams(n=group, temperature=1.0, seed=seed + index * group, max_tokens=max_tokens)
            out = generate(self.engines[arm], [prompt], params)[0]
            tokens.append([list(c.token_ids) for c in out.outputs])
            texts.append([c.text for c in out.outputs])
        seconds = time.perf_counter() - start
        row = {"tokens": tokens, "texts": texts, "seconds": seconds, "completion_tokens": sum(len(t) for ts in tokens for t in ts)}
        if proposer is not None:
            row.update(_drafting(before, _proposer_counts(proposer), proposer.config.prefetch and proposer.config.drafting))
        return row

    def update(self, weights) -> float:
        """Load the new weights into every arm's engine; the seconds it took (all engines)."""
        from kvforge.vllm.weights import update_vllm_weights

        return sum(update_vllm_weights(llm, weights) for llm in self.engines.values())

    def close(self) -> None:
        from kvforge.vllm.engine import close_llm

        for llm in self.engines.values():
            close_llm(llm)


def rollout_seed(seed: int, epoch: int, problems: int, group: int) -> int:
    """The first vLLM request seed of an epoch under the run's `seed`: the epoch's samples take
    request seeds first .. first + problems x G - 1, and no two epochs share one."""
    return (seed * 1000 + epoch) * problems * group


def _proposer_counts(proposer) -> dict:
    if proposer is None:
        return {}
    return {**proposer.stats.as_dict(), **proposer.stats.by_source()}


def _drafting(before: dict, after: dict, prefetch: bool) -> dict:
    """The proposer's statistics over one pass (counters after minus before), in `SpecStats`'s terms."""
    def delta(key):
        return after[key] - before[key]

    summary = SpecStats(k=1)
    summary.sources, summary.proposals = _minus(after["sources"], before["sources"]), _minus(after["matched"], before["matched"])
    steps = max(delta("request_steps"), 1)
    return {
        "rows_drafted": delta("drafted_steps") / steps,
        "mean_accept_len": delta("accepted") / steps,  # per request-step, as `SpecStats` counts it
        "host_ms_per_step": 1e3 * delta("propose_s") / max(delta("calls"), 1),  # the proposer's time per vLLM step
        "prefetch_hit_rate": delta("prefetch_hits") / max(delta("drafted_steps"), 1) if prefetch else None,  # of the verified drafts
        "accept_by_source": summary.accept_by_source,
        "match_by_source": summary.match_by_source,
    }


def _minus(after: dict[str, list[int]], before: dict[str, list[int]]) -> dict[str, list[int]]:
    """Per-source tallies over one pass: the sources it used, their counts after minus before."""
    counts = {s: [a - b for a, b in zip(c, before.get(s, [0] * len(c)))] for s, c in after.items()}
    return {s: c for s, c in counts.items() if c[0]}
