"""`kvforge bench rl`: a small RL loop end to end, rollouts plain and drafted in one run.

Each epoch rolls out P problems of a generated task (`data.rl_tasks`) x G samples at temperature
1 in the rollout engine, twice, arms interleaved group by group (their order alternates from one
pass to the next, so a drift in the CPU's speed falls on both alike; with `repeats` R, each
group's arms run R times, the order flipping between them, A B B A for R = 2, and each arm's
seconds, drafting statistics and acceptance cover its R passes of the same tokens; the draft gate
learns from every pass, as it would from R times the groups): `plain`
(no drafter) and `drafted` (the n-gram drafter with the rollout history: each sample drafts from
its previous-epoch rollout first, then its group's n-grams, the history and the prompt, under
the cost gate). With `ungated`, a third arm, `ungated`, drafts as `drafted` does from a copy of
the same history but verifies every proposal: what drafting reaches on the task where the gate
does not hold it back (its rows drafted are the share of samples' steps with a proposal). The arms
use the same noise keys, so their samples must be token-identical; the report says whether they
were. The drafted arm's samples are scored and make one GRPO update
(`grpo.py`) of a float32 trainer copy of the model, whose weights are then loaded into the
rollout engine in place (`Engine.update_weights`), no restart, and the next epoch begins.

Noise (`noise`): "fresh" keys every sampled token by its epoch too, so every sample is a fresh
draw from the current policy and a previous rollout's token is accepted with the probability
the current policy gives it; "coupled" leaves the epoch out, so a sample replays its previous rollout
wherever the policy's draw did not change: more accepted drafts, but the samples are not fresh
draws given a policy trained on them (the reward per epoch shows what that costs in learning).

Per epoch and arm: tokens/s over the epoch's rollouts (completion tokens over wall seconds),
speedup over plain, KL(new || old) per token of the update that made the epoch's policy (none for
epoch 1), the reward mean, acceptance per draft source (of the drafts verified, and of every
proposal, verified or not, against what the sample then committed: what each source is worth
whatever the gate chose) and the share of steps that drafted.
Held-out reward (greedy, plain) is reported before the first update and after the last.

With `engines` naming vllm (`--engines kvforge,vllm`), vLLM's arms (`rl_vllm.py`: `vllm-plain`,
`vllm-drafted`, `vllm-off`) roll out the same problems each epoch after kvforge's, their order
flipping from one epoch to the next, and
take every update in place through vLLM's own reload. vLLM samples with its own sampler (fresh
draws every epoch); each vLLM row reports its speedup over `vllm-plain` and its reward over its
own samples. The update trains on kvforge's drafted samples, or on `vllm-plain`'s without kvforge.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch

from kvforge.bench.harness import environment
from kvforge.bench.plotting import new_figure, save_figure
from kvforge.data.rl_tasks import TASKS, problems, reward
from kvforge.generation import GenerationConfig
from kvforge.grpo import GrpoConfig, GrpoTrainer, Rollout
from kvforge.prompting import encode_prompt
from kvforge.speculative.gate import step_cost
from kvforge.speculative.history import RolloutHistory
from kvforge.speculative.rollout import DraftConfig, generate_group
from kvforge.speculative.step import SpecStats

NOISES = ("fresh", "coupled")
ENGINES = ("kvforge", "vllm")


def check_settings(task: str, noise: str, epochs: int, group: int, prompts: int, max_tokens: int, k: int, threads: int, heldout: int,
                   lr: float, engines: tuple[str, ...] = ("kvforge",), repeats: int = 1, ungated: bool = False) -> None:
    """A `ValueError` naming the first setting `bench rl` cannot run with (checked before any model loads)."""
    if not engines or any(e not in ENGINES for e in engines):
        raise ValueError(f"unknown engines {','.join(engines) or '(none)'}: use kvforge, vllm or kvforge,vllm")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: use {' or '.join(TASKS)}")
    if noise not in NOISES:
        raise ValueError(f"unknown noise {noise!r}: use fresh or coupled")
    if min(epochs, group, prompts, max_tokens, k, threads, repeats) < 1 or heldout < 0 or not lr > 0:
        raise ValueError("--epochs, -G, --prompts, --max-new-tokens, --k, --threads and --repeats must be >= 1, --heldout >= 0 and --lr > 0")
    if ungated and "kvforge" not in engines:
        raise ValueError("--ungated is an arm of kvforge's engine: add kvforge to --engines")


def bench_rl(
    engine, trainer_model: torch.nn.Module, task: str = "sql", epochs: int = 6, group: int = 8, prompts: int = 4, max_tokens: int = 48,
    noise: str = "fresh", lr: float = 6e-6, k: int = 8, rollout_threads: int = 1, heldout: int = 8, seed: int = 0, progress=None,
    engines: tuple[str, ...] = ("kvforge",), vllm_dir=None, prefetch: bool = False, repeats: int = 1, ungated: bool = False,
) -> dict:
    """The loop of the module docstring over `engine` (kvforge's rollouts; held-out answers always),
    `trainer_model` (a float32 transformers model of the same weights, trained) and, with "vllm" in
    `engines`, vLLM engines over `vllm_dir` (the model's Hugging Face directory). `prefetch`: the
    drafted arms with the (accept length, bonus) prefetcher (its hit rate reported). `repeats`: each
    group's kvforge arms timed that many times; `ungated`: also the arm that verifies every
    proposal (module docstring)."""
    check_settings(task, noise, epochs, group, prompts, max_tokens, k, rollout_threads, heldout, lr, engines, repeats, ungated)
    say = progress or (lambda message: None)
    tokenizer = engine.model.tokenizer
    train = problems(task, "train", prompts)
    encoded = [encode_prompt(tokenizer, p.prompt, chat=True) for p in train]
    trainer = GrpoTrainer(trainer_model, GrpoConfig(lr=lr))
    history = RolloutHistory()
    arms = {"plain": DraftConfig("none", k), "drafted": DraftConfig("ngram", k, prefetch=prefetch)} if "kvforge" in engines else {}
    if arms and ungated:
        arms["ungated"] = DraftConfig("ngram", k, prefetch=prefetch, gate=False)
    train_threads = torch.get_num_threads()
    torch.set_num_threads(rollout_threads)
    warm = GenerationConfig(4, temperature=1.0, seed=seed)
    warm_prompt = encode_prompt(tokenizer, problems(task, "heldout", 1)[0].prompt, chat=True)
    for draft in arms.values():  # first-call costs and the gate's calibration, outside the timings
        generate_group(engine, warm_prompt, group, warm, draft)
    step_cost(engine).forget_rows()  # the warm-up's few tokens teach the gate nothing of the rollouts
    vllm = None
    if "vllm" in engines:
        from kvforge.bench.rl_vllm import VLLM_ARMS, VllmRollouts, rollout_seed

        vllm = VllmRollouts(vllm_dir, engine.dtype, max(map(len, encoded + [warm_prompt])) + max_tokens + k + 16, group, k, say, prefetch)
        vllm.warm(warm_prompt, group)
    trained_on = "drafted" if arms else "vllm-plain"
    heldout_before = _heldout_reward(engine, task, heldout, max_tokens)
    results, kl, update = [], None, None
    try:
        for epoch in range(1, epochs + 1):
            config = GenerationConfig(max_tokens, temperature=1.0, seed=seed, epoch=epoch if noise == "fresh" else 0)
            outcome = {}
            if arms:
                say(f"epoch {epoch}/{epochs}: {' and '.join(arms)} rollouts")
                outcome.update(_roll_out(engine, train, encoded, group, config, arms, history, first=epoch % 2, repeats=repeats))
            for arm in (VLLM_ARMS if epoch % 2 else VLLM_ARMS[::-1]) if vllm else ():
                say(f"epoch {epoch}/{epochs}: {arm} rollouts")
                outcome[arm] = vllm.roll_out(arm, encoded, group, max_tokens, rollout_seed(seed, epoch, len(encoded), group))
            # every pass of the epoch (both arms, every repeat) committed the same tokens
            identical = (all(outcome[arm]["tokens"] == outcome["plain"]["tokens"] and outcome[arm]["repeatable"] for arm in arms)
                         if arms else None)
            rewards = {arm: [[reward(p, text) for text in texts] for p, texts in zip(train, o["texts"])] for arm, o in outcome.items()}
            for arm in [*arms, *(VLLM_ARMS if vllm else ())]:
                results.append(_row(epoch, arm, noise if arm in arms else "fresh", outcome, rewards[arm], identical if arm in arms else None,
                                    kl, update))
            if epoch == epochs:
                break
            say(f"epoch {epoch}/{epochs}: GRPO update")
            torch.set_num_threads(train_threads)
            groups = [[Rollout(ids, tokens, r) for tokens, r in zip(sample_tokens, rs)]
                      for ids, sample_tokens, rs in zip(encoded, outcome[trained_on]["tokens"], rewards[trained_on])]
            update = trainer.step(groups)
            # vLLM's CPU worker makes torch.set_num_threads a no-op in its process: the update runs
            # at the threads vLLM bound (the rollouts'), and says so
            update["trained_on"], update["threads"] = trained_on, torch.get_num_threads()
            weights = trainer.weights(engine.dtype)
            start = time.perf_counter()
            engine.update_weights(weights)
            update["load_s"] = time.perf_counter() - start
            if vllm:
                update["vllm_load_s"] = vllm.update(weights)
            del weights
            torch.set_num_threads(rollout_threads)
            for draft in list(arms.values())[:1]:  # weight copies repacked here, outside the arms' timings
                generate_group(engine, warm_prompt, group, warm, draft)
            kl = update["kl_per_token"]
    finally:
        if vllm:
            vllm.close()
    torch.set_num_threads(train_threads)
    heldout_after = _heldout_reward(engine, task, heldout, max_tokens) if epochs > 1 else heldout_before
    extra = {}
    if vllm:
        import vllm as vllm_package

        extra = {"vllm": vllm_package.__version__}
    return {
        "command": "bench rl", "task": task, "noise": noise, "engines": list(engines), "prefetch": prefetch, "repeats": repeats, "epochs": epochs,
        "group": group, "prompts": prompts,
        "max_tokens": max_tokens, "temperature": 1.0, "k": k, "lr": lr, "seed": seed, "rollout_threads": rollout_threads,
        "train_threads": update["threads"] if update else train_threads, "ungated": ungated, "heldout_reward": {"before": heldout_before, "after": heldout_after, "problems": heldout},
        **environment(engine), **extra, "threads": rollout_threads, "results": results,
    }


def _row(epoch: int, arm: str, noise: str, outcome: dict, rewards: list[list[float]], identical, kl, update) -> dict:
    """One (epoch, arm) result; speedups against the arm's own engine's plain arm."""
    o = outcome[arm]
    rate = o["completion_tokens"] / o["seconds"]
    plain = outcome["vllm-plain" if arm.startswith("vllm-") else "plain"]
    drafting = arm not in ("plain", "vllm-plain")  # plain arms draft nothing: null, not zeros
    row = {
        "epoch": epoch, "arm": arm, "noise": noise, "tokens_per_s": rate, "speedup_vs_plain": rate / (plain["completion_tokens"] / plain["seconds"]),
        "completion_tokens": o["completion_tokens"], "seconds": o["seconds"], "token_identical": identical,
        "kl_to_previous": kl, "reward_mean": statistics.fmean(r for rs in rewards for r in rs),
        **{key: o.get(key) if drafting else None for key in ("accept_by_source", "match_by_source", "mean_accept_len", "rows_drafted", "host_ms_per_step",
                                                              "prefetch_hit_rate")},
        "update": update,
    }
    if arm == "vllm-drafted":  # against vLLM's speculative path that never drafts: the floor
        off = outcome["vllm-off"]
        row["speedup_vs_off"] = rate / (off["completion_tokens"] / off["seconds"])
    return row


def _roll_out(engine, train, encoded, group: int, config: GenerationConfig, arms: dict[str, DraftConfig], history, first: int,
              repeats: int = 1) -> dict:
    """Every arm's pass over the problems, the arms taking turns on each problem, `repeats` times
    (the order flips from one pass to the next, a pass being one problem's repeat; `first` 1
    starts with the first arm, 0 with the last): per arm the samples' tokens and texts per
    problem, its wall seconds (the mean over the repeats) and its drafting statistics summed over
    the groups and repeats. The drafted arm drafts from and records into `history` once, at its
    last repeat; its earlier repeats, and every pass of the ungated arm, draft from copies of
    what `history` held before the group (copied outside the timings). A repeat whose tokens
    differ from the first's marks the arm `repeatable` False."""
    names = list(arms)
    runs = {arm: {"tokens": [], "texts": [], "seconds": 0.0, "stats": SpecStats(draft.k), "probes": 0, "hits": 0, "repeatable": True}
            for arm, draft in arms.items()}
    turn = 0
    for problem, ids in zip(train, encoded):
        before = copy.deepcopy(history) if (repeats > 1 or "ungated" in arms) and "drafted" in arms else None
        for repeat in range(repeats):
            for arm in names if (turn + first) % 2 else names[::-1]:
                run = runs[arm]
                drafts_from = None
                if arm == "drafted":  # the snapshot itself at the last repeat that needs one, unless the ungated arm needs it still
                    last_use = repeat == repeats - 2 and "ungated" not in arms
                    drafts_from = history if repeat == repeats - 1 else before if last_use else copy.deepcopy(before)
                elif arm == "ungated":
                    drafts_from = copy.deepcopy(before)
                start = time.perf_counter()
                outputs, stats = generate_group(engine, ids, group, config, arms[arm], history=drafts_from, rollout_key=problem.key)
                run["seconds"] += (time.perf_counter() - start) / repeats
                tokens = [g.token_ids for g in outputs]
                if stats is not None:
                    run["stats"].add(stats)
                    run["probes"], run["hits"] = run["probes"] + stats.probes, run["hits"] + stats.hits
                if repeat:
                    run["repeatable"] &= tokens == run["tokens"][-1]
                    continue
                run["tokens"].append(tokens)
                run["texts"].append([g.text for g in outputs])
            turn += 1
    outcome = {}
    for arm, run in runs.items():
        total, probes = run["stats"], run["probes"]
        summary = total.as_dict()
        outcome[arm] = {
            "tokens": run["tokens"], "texts": run["texts"], "seconds": run["seconds"], "repeatable": run["repeatable"],
            "completion_tokens": sum(len(t) for ts in run["tokens"] for t in ts), "rows_drafted": total.rows_drafted,
            **{key: summary[key] for key in ("mean_accept_len", "host_ms_per_step", "accept_by_source", "match_by_source")},
            "prefetch_hit_rate": run["hits"] / probes if probes else None,
        }
    return outcome


def _heldout_reward(engine, task: str, count: int, max_tokens: int) -> float | None:
    """Mean reward of greedy answers to `count` held-out problems (None for none)."""
    if count == 0:
        return None
    held = problems(task, "heldout", count)
    prompts = [encode_prompt(engine.model.tokenizer, p.prompt, chat=True) for p in held]
    outputs = engine.generate(prompts, GenerationConfig(max_tokens))
    return statistics.fmean(reward(p, g.text) for p, g in zip(held, outputs))


def plot(reports: list[dict], path: Path) -> Path:
    """PNG: drafted speedup against the KL of the update before each epoch, and reward per epoch,
    one series per report (noise mode) and drafting engine."""
    fig, (speed_ax, reward_ax) = new_figure(2, (11, 4))
    for report in reports:
        for arm in ("drafted", "vllm-drafted"):
            drafted = [r for r in report["results"] if r["arm"] == arm]
            if not drafted:
                continue
            label = f"{report['noise'] if arm == 'drafted' else 'vLLM, fresh'} noise"
            moved = [r for r in drafted if r["kl_to_previous"] is not None]
            speed_ax.scatter([r["kl_to_previous"] for r in moved], [r["speedup_vs_plain"] for r in moved], label=label)
            reward_ax.plot([r["epoch"] for r in drafted], [r["reward_mean"] for r in drafted], marker="o", label=label)
    speed_ax.axhline(1.0, color="grey", lw=0.5)
    speed_ax.set_xscale("symlog", linthresh=1e-4)
    speed_ax.set_xlabel("KL(new || old) per token of the update before the epoch")
    speed_ax.set_ylabel("drafted tokens/s vs the same engine's plain")
    reward_ax.set_xlabel("epoch")
    reward_ax.set_ylabel("mean reward of the rollouts")
    for ax in (speed_ax, reward_ax):
        ax.legend()
    first = reports[0]
    fig.suptitle(f"bench rl --task {first['task']}: G = {first['group']}, {first['prompts']} problems, {first.get('dtype', '')}")
    return save_figure(fig, path)
