"""`kvforge eval speed`: SPEED against exact on held-out conversations.

Arms (model, policy): exact (base, full depth), speed (base, SPEED: training-free), and with an
adapter: adapted_exact (adapted, full depth) and adapted_speed (adapted, SPEED). Loss is the
assistant reply's, given the conversation before it, teacher forced: the reply rows run full
depth, as decode tokens do. Gaps are perplexity % over exact with a paired bootstrap 95 %
interval; adapted_speed is also compared with adapted_exact, which separates the effect of the
policy from that of the fine-tuning. Needles: RULER niah_single style, needle in the prompt,
greedy answer, string match.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvforge.data.replies import reply_samples
from kvforge.data.tasks import answered, needle_sample
from kvforge.engine import Engine
from kvforge.evaluate.metrics import mean_nll, paired_bootstrap_ci, ppl_gap_pct
from kvforge.fill.speed import SpeedConfig, speed_plan
from kvforge.fill.speed_fit import reply_nll, sample_plan
from kvforge.generation import GenerationConfig


@dataclass(frozen=True)
class SpeedEvalSettings:
    samples: int = 40
    max_tokens: int = 1024  # prompt + reply
    needles: int = 20
    needle_tokens: int = 1024
    needle_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)


def eval_speed(base: Engine, adapted: Engine | None, speed: SpeedConfig, settings: SpeedEvalSettings, progress=None) -> dict:
    arms = {"exact": (base, None), "speed": (base, speed)}
    if adapted is not None:
        arms.update({"adapted_exact": (adapted, None), "adapted_speed": (adapted, speed)})
    tok = base.model.tokenizer
    samples = list(itertools.islice(reply_samples(tok, "held_out", settings.max_tokens), settings.samples))
    if len(samples) < 2:
        raise ValueError(f"fewer than 2 held-out conversations fit in {settings.max_tokens} tokens")
    nll: dict[str, list[torch.Tensor]] = {name: [] for name in arms}
    for i, sample in enumerate(samples):
        if progress:
            progress(f"reply {i + 1}/{len(samples)} ({sample.prompt_tokens} prompt + {sample.reply_tokens} reply tokens)")
        for name, (engine, policy) in arms.items():
            with torch.inference_mode():
                nll[name].append(reply_nll(engine, sample, sample_plan(engine, sample, policy)).cpu())
    every = [torch.ones_like(x, dtype=torch.bool) for x in nll["exact"]]
    report = {
        "samples": len(samples),
        "reply_tokens": sum(s.reply_tokens for s in samples),
        "prompt_tokens_mean": sum(s.prompt_tokens for s in samples) / len(samples),
        "arms": {name: {"nll": mean_nll(nll[name], every)} for name in arms},
        "ppl_gap_pct": {},
        "ppl_gap_ci": {},
    }
    for name in arms:
        if name != "exact":
            report["ppl_gap_pct"][name] = ppl_gap_pct(nll[name], nll["exact"], every)
            report["ppl_gap_ci"][name] = paired_bootstrap_ci(nll[name], nll["exact"], every)
    # the policy's own cost: SPEED vs full depth on the same weights
    report["policy_gap_pct"] = {"training_free": report["ppl_gap_pct"]["speed"]}
    report["policy_gap_ci"] = {"training_free": report["ppl_gap_ci"]["speed"]}
    if adapted is not None:
        report["policy_gap_pct"]["adapted"] = ppl_gap_pct(nll["adapted_speed"], nll["adapted_exact"], every)
        report["policy_gap_ci"]["adapted"] = paired_bootstrap_ci(nll["adapted_speed"], nll["adapted_exact"], every)
    report["needle"] = _needles(arms, settings, progress)
    report["needle_samples"] = settings.needles
    return report


def _needles(arms: dict, settings: SpeedEvalSettings, progress) -> dict:
    correct = {name: 0 for name in arms}
    config = GenerationConfig(max_new_tokens=16)
    tok = next(iter(arms.values()))[0].model.tokenizer
    for i in range(settings.needles):
        depth = settings.needle_depths[i % len(settings.needle_depths)]
        sample = needle_sample(tok, settings.needle_tokens, depth, seed=i)
        if progress:
            progress(f"needle {i + 1}/{settings.needles} at depth {depth:.2f}")
        for name, (engine, policy) in arms.items():
            plan = None if policy is None else speed_plan(len(sample.prompt), policy, engine.num_layers)
            correct[name] += answered(engine.generate(sample.prompt, config, plan=plan)[0].text, sample.value)
    n = settings.needles
    return {name: (100.0 * c / n if n else None) for name, c in correct.items()}


def summary(report: dict, model: str, speed: SpeedConfig, num_layers: int, adapter: str | None) -> dict:
    """The `eval speed --json` object."""
    return {
        "command": "eval speed",
        "model": model,
        "method": "speed",
        "tokens": report["prompt_tokens_mean"],
        "cut": speed.cut,
        "cut_fraction": speed.fraction(num_layers),
        "anchors_first": speed.first,
        "tail": speed.tail,
        "adapter": adapter,
        "samples": report["samples"],
        "reply_tokens": report["reply_tokens"],
        "nll": {name: a["nll"] for name, a in report["arms"].items()},
        "ppl_gap_pct": report["ppl_gap_pct"],
        "ppl_gap_ci": report["ppl_gap_ci"],
        "policy_gap_pct": report["policy_gap_pct"],
        "policy_gap_ci": report["policy_gap_ci"],
        "needle": report["needle"],
        "needle_samples": report["needle_samples"],
    }
