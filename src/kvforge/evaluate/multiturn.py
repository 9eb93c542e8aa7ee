"""Multi-turn evaluation: per-turn loss when the two models take turns.

Held-out conversations with at least `turns` user→assistant exchanges are replayed turn by turn
(user messages and replies capped in characters to bound a run's time on a CPU); party 0 (the translator's
source) speaks turn 1, party 1 turn 2, and so on. At each turn the speaker teacher-forces the
real reply, and its loss in bits per byte of the reply is recorded for three modes (see
`translate.session`): native re-prefill (reference), alternated translation, naive
retranslation of the whole prefix. Each mode replays the conversation from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.data.sharegpt import conversations
from kvforge.evaluate.lingo import LN2, bootstrap_bpb
from kvforge.translate.session import MODES, Conversation


@dataclass(frozen=True)
class MultiTurnSettings:
    conversations: int = 12
    turns: int = 6
    user_chars: int = 300
    reply_chars: int = 300


def exchanges(split: str, settings: MultiTurnSettings) -> list[list[tuple[str, str]]]:
    """`settings.conversations` conversations' first `turns` (user, reply) exchanges, capped."""
    out = []
    for conv in conversations(split):
        pairs = [(q.strip()[: settings.user_chars], a.strip()[: settings.reply_chars])
                 for (rq, q), (ra, a) in zip(conv.turns, conv.turns[1:]) if rq == "user" and ra == "assistant"]
        if len(pairs) >= settings.turns and all(q and len(a) >= 10 for q, a in pairs[: settings.turns]):
            out.append(pairs[: settings.turns])
            if len(out) == settings.conversations:
                return out
    raise ValueError(f"the {split} split holds fewer than {settings.conversations} conversations of {settings.turns}+ turns")


@torch.inference_mode()
def eval_multiturn(engines, translators, settings: MultiTurnSettings, modes=MODES, progress=None) -> dict:
    """Per mode and turn: bits per byte over all conversations, with per-conversation values for
    bootstrap intervals; plus the rows translated per switch (what a switch costs)."""
    convs = exchanges("held_out", settings)
    nats = {m: [[0.0] * settings.turns for _ in convs] for m in modes}
    translated = {m: [0] * settings.turns for m in modes}
    byte_counts = [[0] * settings.turns for _ in convs]
    tokens = 0
    for c, pairs in enumerate(convs):
        for mode in modes:
            conv = Conversation(engines, None if mode == "native" else translators, mode)
            for t, (user, reply) in enumerate(pairs):
                loss, size, scored = conv.score(conv.prompt_segment(user), " " + reply)
                tokens += scored
                nats[mode][c][t] = loss
                byte_counts[c][t] = size
                if t:
                    translated[mode][t] += conv.switches[-1].translated_rows
        if progress:
            progress(c + 1, len(convs))
    report = {"conversations": len(convs), "turns": settings.turns, "tokens": tokens, "speakers": [engines[t % 2].model.name for t in range(settings.turns)]}
    for mode in modes:
        per_turn = [sum(nats[mode][c][t] for c in range(len(convs))) / (LN2 * sum(b[t] for b in byte_counts)) for t in range(settings.turns)]
        report[mode] = {
            "bpb_per_turn": per_turn,
            "bpb_ci_per_turn": [bootstrap_bpb([n[t] for n in nats[mode]], [b[t] for b in byte_counts]) for t in range(settings.turns)],
            "translated_rows_per_switch": [r / len(convs) for r in translated[mode]],
        }
    for mode in modes:
        if mode != "native" and "native" in modes:
            report[mode]["gap_to_native_percent"] = [100 * (m / n - 1) for m, n in zip(report[mode]["bpb_per_turn"], report["native"]["bpb_per_turn"])]
    return report


def plot_turns(report: dict, path, title: str) -> str:
    """Per-turn bits per byte, one line per mode, speakers on the x axis."""
    from pathlib import Path

    from kvforge.bench.plotting import new_figure, save_figure

    fig, ax = new_figure(1, (7, 4))
    turns = list(range(1, report["turns"] + 1))
    for mode in MODES:
        if mode in report:
            low, high = zip(*report[mode]["bpb_ci_per_turn"])
            ax.plot(turns, report[mode]["bpb_per_turn"], marker="o", label=mode)
            ax.fill_between(turns, low, high, alpha=0.15)
    ax.set_xticks(turns, [f"{t}\n{s}" for t, s in zip(turns, report["speakers"])], fontsize=7)
    ax.set_xlabel("turn (speaker)")
    ax.set_ylabel("bits per byte of the reply")
    ax.set_title(title, fontsize=9)
    ax.legend()
    return str(save_figure(fig, Path(path)))
