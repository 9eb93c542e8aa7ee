"""`kvforge demo`: one long held-out conversation answered by every method, one row each.

The exact engine answers a summary question first; RidgeFill, SPEED and the KV-Lingo hand-off
answer the same question from their forged caches; NgramRL drafting answers an extraction
question over the same conversation (a copy is where drafting pays) and is timed against plain
decoding of that question. Artifacts are resolved as the CLI resolves them
(`artifacts.find_artifact`): a user's own fit, else the ones shipped for the packaged models;
a missing one is fitted once at a reduced size and cached, and its row says so.

`degeneration` and `shared_content_words` are the checks a demo answer must pass: no word or
phrase repeated four times in a row, and some content word in common with exact's answer.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from kvforge.artifacts import default_translator_path, find_artifact, shipped_manifest
from kvforge.data.prompts import held_out_conversations
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig
from kvforge.plan import PrefillPlan, PrefillReport
from kvforge.prompting import encode_prompt

QUESTION = "Summarize the conversation above in two sentences."
EXTRACT_QUESTION = "Repeat the user's first message above word for word."
DEMO_FIT_TOKENS = 60_000  # a first-run fit for a model with no shipped maps; `kvforge fit ridgefill` defaults to 200K
PARTNERS = {"smollm2-135m": "gemma3-270m", "gemma3-270m": "smollm2-135m"}  # the packaged KV-Lingo pair
DEMO_LINGO_CONVERSATIONS = 16  # likewise for a pair with no shipped translator; `kvforge fit lingo` defaults to 320
# The target prefills the text's last 128 tokens itself over the translated rows (`--native-tail`):
# the newest message and the question are its own. Without it the shipped translator's answer to
# the demo's question repeats one word ("Shuttle" x50); with it, it answers (docs/results.md#kv-lingo).
HANDOFF_NATIVE_TAIL = 128


@dataclass
class DemoRow:
    method: str
    prompt_tokens: int
    ttft_s: float
    decode_tokens_per_s: float
    answer: str
    question: str = "summary"  # "summary" (QUESTION) or "extract" (EXTRACT_QUESTION)
    facts: dict = field(default_factory=dict)  # what the closing line reports (speedups, artifact, acceptance)


def transcript(min_chars: int = 5000, max_chars: int = 9000) -> str:
    """A held-out ShareGPT conversation of a few thousand tokens, as "User: ... Assistant: ..." text."""
    conv = held_out_conversations(1, min_chars=min_chars, max_chars=max_chars)[0]
    return "\n\n".join(f"{role.capitalize()}: {text}" for role, text in conv.turns)


def _answer(text: str) -> str:
    return " ".join(text.split())


def run_exact(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    out = engine.generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens))[0]
    return DemoRow("exact", out.prompt_tokens, out.ttft_s, out.decode_tokens_per_s, _answer(out.text))


def demo_maps(engine: Engine):
    """RidgeFill maps for the engine's model: a fit's or the shipped ones, else fitted once and cached."""
    from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill
    from kvforge.fill.maps import RidgeMaps
    from kvforge.fill.ridgefill import PRESETS, preset_split

    path = find_artifact("maps", engine.model.name)
    if not path.is_file():
        splits = tuple(preset_split(name, engine.num_layers) for name in PRESETS)
        fit_ridgefill(engine, CalibrationConfig(splits, tokens=DEMO_FIT_TOKENS), engine.model.name).save(path)
    return RidgeMaps.load(path), path


def _named(name: str, plan: PrefillPlan, tokens: int, num_layers: int) -> str:
    """The row's name, saying so when the method's plan ran exact."""
    ran = PrefillReport.planned(plan, tokens, num_layers)
    return name if ran.prefill != "exact" else f"{name}, ran exact: {ran.reason}"


def run_ridgefill(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    from kvforge.fill.ridgefill import resolve, ridgefill_plan

    maps, path = demo_maps(engine)
    config, maps = resolve(engine, maps, "fast")
    plan = ridgefill_plan(engine, prompt_ids, config, maps)
    out = engine.generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens), plan=plan)[0]
    name = _named(f"ridgefill (split {config.split}/{engine.num_layers})", plan, len(prompt_ids), engine.num_layers)
    return DemoRow(name, out.prompt_tokens, out.ttft_s, out.decode_tokens_per_s, _answer(out.text), facts={"artifact": path.name})


def run_speed(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    """SPEED at the default cut, adapted with the model's adapter for that cut (a fit's or the
    shipped one) and its whole policy; training-free when there is none (the row says which)."""
    import torch

    from kvforge.errors import ArtifactError
    from kvforge.fill.speed import DEFAULT_CUT, resolve, resolve_cut

    path = find_artifact("adapter", engine.model.name, cut=resolve_cut(DEFAULT_CUT, engine.num_layers))
    adapted = path.is_file()
    try:
        speed = resolve(engine, adapter=path if adapted else None)
    except ArtifactError:  # an adapter for other weights: run training-free
        speed, adapted = resolve(engine), False
    plan = speed.plan(len(prompt_ids))
    with torch.inference_mode():
        out = speed.engine.generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens), plan=plan)[0]
    name = f"speed (cut {speed.config.cut}/{engine.num_layers}, {'adapted' if adapted else 'training-free'})"
    facts = {"artifact": path.name} if adapted else {}
    return DemoRow(_named(name, plan, len(prompt_ids), engine.num_layers), out.prompt_tokens, out.ttft_s,
                   out.decode_tokens_per_s, _answer(out.text), facts=facts)


def run_ngram(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    """Lossless n-gram drafting on the extraction question, timed against plain decoding of the
    same question in the same process (plain first, then drafted); the row records both rates and
    whether the tokens are the same (they must be: greedy drafting commits plain decoding's tokens)."""
    from kvforge.speculative.rollout import DraftConfig, generate_group

    config = GenerationConfig(max_new_tokens=max_new_tokens)
    plain = engine.generate(prompt_ids, config)[0]
    outputs, stats = generate_group(engine, prompt_ids, 1, config, DraftConfig("ngram"))
    out = outputs[0]
    facts = {
        "plain_tokens_per_s": plain.decode_tokens_per_s,
        "accept": stats.mean_accept_len,
        "k": stats.k,
        "same_tokens": out.token_ids == plain.token_ids,
    }
    name = f"ngram drafting (accepts {stats.mean_accept_len:.1f} of {stats.k} a step)"
    return DemoRow(name, out.prompt_tokens, out.ttft_s, out.decode_tokens_per_s, _answer(out.text), "extract", facts)


def run_handoff(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    """The other packaged model prefills the same text; its cache is translated into this model's
    and this model answers without re-prefilling. The translator is the pair's default
    (`artifacts.default_translator_path`: a fit's before a shipped one, stage 2 before stage 1),
    fitted once at a reduced size when there is none. The target prefills the last
    `HANDOFF_NATIVE_TAIL` tokens itself. TTFT is the hand-off's: translation, that tail and the
    first step (the source already held the conversation)."""
    from kvforge.models.loading import load_model
    from kvforge.translate.align import tokenize
    from kvforge.translate.fit import LingoFitConfig, fit_lingo
    from kvforge.translate.handoff import hand_off
    from kvforge.translate.translator import Translator

    partner = PARTNERS.get(engine.model.name)
    if partner is None:
        return DemoRow("handoff (no packaged partner for this model)", len(prompt_ids), 0.0, 0.0, "")
    source = Engine(load_model(partner, device=str(engine.device), dtype=engine.dtype))
    path = default_translator_path(partner, engine.model.name)
    if not path.is_file():
        # depth ν = 3: the assignment that holds up on so few conversations (docs/lingo.md)
        fit_lingo(source, engine, LingoFitConfig(assign="depth", nu=3, conversations=DEMO_LINGO_CONVERSATIONS)).save(path)
    translator = Translator.load(path)
    # The rendered chat template holds its special tokens: tokenized once, without adding them again.
    text = engine.model.tokenizer.decode(prompt_ids)
    h = hand_off(translator, source, engine, text, target_tokens=tokenize(engine.model.tokenizer, text, add_special_tokens=False),
                 native_tail=HANDOFF_NATIVE_TAIL)
    out = engine.generate([h.pending], GenerationConfig(max_new_tokens=max_new_tokens), cache=h.cache)[0]
    name = f"handoff from {partner} (stage {translator.info.get('stage', 1)}, native tail {HANDOFF_NATIVE_TAIL})"
    return DemoRow(name, len(h.target_ids), h.translate_s + out.ttft_s, out.decode_tokens_per_s, _answer(out.text),
                   facts={"artifact": path.name})


DEMO_METHODS = {"exact": run_exact, "ridgefill": run_ridgefill, "speed": run_speed, "ngram": run_ngram, "handoff": run_handoff}


def run_demo(engine: Engine, max_new_tokens: int = 64, progress=None) -> tuple[list[DemoRow], str]:
    """(rows, the summary prompt's text) for every demo method on one held-out conversation.
    `progress(name)` is called before each method runs."""
    conversation = transcript()
    prompts = {question: f"{conversation}\n\n{text}" for question, text in (("summary", QUESTION), ("extract", EXTRACT_QUESTION))}
    ids = {question: encode_prompt(engine.model.tokenizer, prompt, chat=True) for question, prompt in prompts.items()}
    rows = []
    for name, run in DEMO_METHODS.items():
        if progress is not None:
            progress(name)
        rows.append(run(engine, ids["extract" if name == "ngram" else "summary"], max_new_tokens))
    return rows, prompts["summary"]


# --- what a demo answer must pass ------------------------------------------------------------

_WORD = re.compile(r"[A-Za-z0-9']+")
STOPWORDS = frozenset(
    "a an and are as at be but by can do does for from had has have he her his how i if in into is it its me my "
    "no not of on or our she so than that the their them then there these they this to was we were what when "
    "which who will with would you your about also more some such user assistant conversation summary".split()
)


def degeneration(answer: str, times: int = 4, longest: int = 8) -> str | None:
    """The first word or phrase (up to `longest` words) repeated `times` times in a row, or None."""
    words = [w.lower() for w in _WORD.findall(answer)]
    for n in range(1, longest + 1):
        for start in range(len(words) - n * times + 1):
            phrase = words[start:start + n]
            if all(words[start + i * n:start + (i + 1) * n] == phrase for i in range(1, times)):
                return " ".join(phrase)
    return None


def content_words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text) if len(w) > 3 and w.lower() not in STOPWORDS}


def shared_content_words(answer: str, reference: str) -> set[str]:
    """The content words (longer than 3 letters, not stopwords) `answer` shares with `reference`."""
    return content_words(answer) & content_words(reference)


# --- the closing lines ---------------------------------------------------------------------------

DOCS = {"ridgefill": "docs/results.md#ridgefill", "speed": "docs/results.md#speed", "ngram": "docs/results.md#ngramrl-drafting",
        "handoff": "docs/results.md#kv-lingo", "exact": "docs/results.md#exact-engine"}


def _quality(artifact: str | None) -> str:
    """The shipped artifact's held-out quality cost, as its manifest records it."""
    entry = shipped_manifest().get(artifact or "", {})
    held_out = entry.get("held_out")
    return f"held-out {held_out['figure']} {held_out['value']}" if held_out else "held-out quality: see the docs"


def closing_lines(rows: list[DemoRow]) -> list[str]:
    """One line per method: its speedup in this run, its quality cost on held-out data, where to read more."""
    exact = rows[0]
    lines = [f"exact: the reference (transformers' logits); TTFT {exact.ttft_s:.2f} s for {exact.prompt_tokens} tokens. {DOCS['exact']}"]
    for row in rows[1:]:
        key = row.method.split()[0]
        if key == "ngram":
            plain = row.facts["plain_tokens_per_s"]
            ratio = row.decode_tokens_per_s / plain if plain else 0.0
            verdict = "drafting paid" if ratio >= 1 else "drafting did not pay on this question: few drafts were accepted"
            same = "same tokens as plain decoding" if row.facts["same_tokens"] else "TOKENS DIFFER from plain decoding"
            lines.append(f"ngram: decode {ratio:.2f}x plain on the extraction question ({verdict}); lossless: {same}. {DOCS[key]}")
            continue
        speedup = exact.ttft_s / row.ttft_s if row.ttft_s else 0.0
        lines.append(f"{key}: TTFT {speedup:.2f}x exact here; {_quality(row.facts.get('artifact'))}. {DOCS.get(key, 'docs/results.md')}")
    return lines


def timed_demo(engine: Engine, max_new_tokens: int = 64, progress=None) -> tuple[list[DemoRow], str, float]:
    """`run_demo` with its wall time."""
    start = time.perf_counter()
    rows, prompt = run_demo(engine, max_new_tokens, progress)
    return rows, prompt, time.perf_counter() - start
