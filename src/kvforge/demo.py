"""`kvforge demo`: a long real prompt answered by each method, one row per method.

Each method issue adds its row to `DEMO_METHODS`; the exact engine is the first row. Methods are
resolved by the library (`fill.ridgefill.resolve`, `fill.speed.resolve`, `artifacts.artifact_path`),
as the CLI and the server resolve them; a row whose method ran exact says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.artifacts import artifact_path, default_translator_path
from kvforge.data.prompts import held_out_conversations
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig
from kvforge.plan import PrefillPlan, PrefillReport
from kvforge.prompting import encode_prompt

QUESTION = "Summarize the conversation above in two sentences."


@dataclass
class DemoRow:
    method: str
    prompt_tokens: int
    ttft_s: float
    decode_tokens_per_s: float
    answer: str


def demo_prompt(tokenizer, min_chars: int = 5000, max_chars: int = 9000) -> str:
    """A held-out ShareGPT conversation (a few thousand tokens) followed by a question about it."""
    conv = held_out_conversations(1, min_chars=min_chars, max_chars=max_chars)[0]
    transcript = "\n\n".join(f"{role.capitalize()}: {text}" for role, text in conv.turns)
    return f"{transcript}\n\n{QUESTION}"


def run_exact(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    out = engine.generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens))[0]
    return DemoRow("exact", out.prompt_tokens, out.ttft_s, out.decode_tokens_per_s, out.text.strip())


DEMO_FIT_TOKENS = 60_000  # a few minutes here; `kvforge fit ridgefill` defaults to 200K


def demo_maps(engine: Engine):
    """RidgeFill maps for the engine's model: the cached ones, or fitted once and cached."""
    from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill
    from kvforge.fill.maps import RidgeMaps
    from kvforge.fill.ridgefill import PRESETS, preset_split

    path = artifact_path("maps", engine.model.name)
    if not path.is_file():
        splits = tuple(preset_split(name, engine.num_layers) for name in PRESETS)
        fit_ridgefill(engine, CalibrationConfig(splits, tokens=DEMO_FIT_TOKENS), engine.model.name).save(path)
    return RidgeMaps.load(path)


def _named(name: str, plan: PrefillPlan, tokens: int, num_layers: int) -> str:
    """The row's name, saying so when the method's plan ran exact."""
    ran = PrefillReport.planned(plan, tokens, num_layers)
    return name if ran.prefill != "exact" else f"{name}, ran exact: {ran.reason}"


def run_ridgefill(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    from kvforge.fill.ridgefill import resolve, ridgefill_plan

    config, maps = resolve(engine, demo_maps(engine), "fast")
    plan = ridgefill_plan(engine, prompt_ids, config, maps)
    out = engine.generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens), plan=plan)[0]
    name = _named("ridgefill (fast)", plan, len(prompt_ids), engine.num_layers)
    return DemoRow(name, out.prompt_tokens, out.ttft_s, out.decode_tokens_per_s, out.text.strip())


def run_speed(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    """SPEED at the default cut; adapted (with the adapter's whole policy) when `kvforge fit speed`
    left an adapter for this model and cut in the default place, training-free otherwise (the
    row's name says which)."""
    import torch

    from kvforge.errors import ArtifactError
    from kvforge.fill.speed import DEFAULT_CUT, resolve, resolve_cut

    path = artifact_path("adapter", engine.model.name, cut=resolve_cut(DEFAULT_CUT, engine.num_layers))
    adapted = path.is_file()
    try:
        speed = resolve(engine, adapter=path if adapted else None)
    except ArtifactError:  # an adapter for other weights: run training-free
        speed, adapted = resolve(engine), False
    plan = speed.plan(len(prompt_ids))
    with torch.inference_mode():
        out = speed.engine.generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens), plan=plan)[0]
    name = f"speed (cut {speed.config.cut}/{engine.num_layers}{', adapted' if adapted else ''})"
    return DemoRow(_named(name, plan, len(prompt_ids), engine.num_layers), out.prompt_tokens, out.ttft_s, out.decode_tokens_per_s, out.text.strip())


def run_ngram(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    """Exact prefill, then lossless n-gram speculative decoding: the same greedy answer as exact."""
    from kvforge.speculative.rollout import DraftConfig, generate_group

    outputs, stats = generate_group(engine, prompt_ids, 1, GenerationConfig(max_new_tokens=max_new_tokens), DraftConfig("ngram"))
    out = outputs[0]
    name = f"ngram drafting (accept {stats.mean_accept_len:.1f}/{stats.k})"
    return DemoRow(name, out.prompt_tokens, out.ttft_s, out.decode_tokens_per_s, out.text.strip())


PARTNERS = {"smollm2-135m": "gemma3-270m", "gemma3-270m": "smollm2-135m"}  # the packaged KV-Lingo pair
DEMO_LINGO_CONVERSATIONS = 16  # a first-run fit of a few minutes; `kvforge fit lingo` defaults to 320 (~50 min here)


def run_handoff(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> DemoRow:
    """The other packaged model prefills the same text; its cache is translated into this
    model's and this model answers without re-prefilling. The translator: the pair's default
    (`artifacts.default_translator_path`: stage 2 when `kvforge fit lingo --stage 2` left one,
    else stage 1, fitted once when missing). TTFT is the hand-off's: translation + the first step (the source
    already held the conversation)."""
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
        # depth ν = 3: the setting measured on so few rows (docs/lingo.md); ν = 5 maps want the default's 320 conversations.
        fit_lingo(source, engine, LingoFitConfig(assign="depth", nu=3, conversations=DEMO_LINGO_CONVERSATIONS)).save(path)
    translator = Translator.load(path)
    # The rendered chat template holds its special tokens: tokenized once, without adding them again.
    text = engine.model.tokenizer.decode(prompt_ids)
    h = hand_off(translator, source, engine, text, target_tokens=tokenize(engine.model.tokenizer, text, add_special_tokens=False))
    out = engine.generate([h.pending], GenerationConfig(max_new_tokens=max_new_tokens), cache=h.cache)[0]
    return DemoRow(f"handoff from {partner} (stage {translator.info.get('stage', 1)})", len(h.target_ids), h.translate_s + out.ttft_s, out.decode_tokens_per_s, out.text.strip())


DEMO_METHODS = {"exact": run_exact, "ridgefill": run_ridgefill, "speed": run_speed, "ngram": run_ngram, "handoff": run_handoff}


def run_demo(engine: Engine, max_new_tokens: int = 64) -> tuple[list[DemoRow], str]:
    """(rows, the prompt text) for every demo method on the same prompt."""
    prompt = demo_prompt(engine.model.tokenizer)
    ids = encode_prompt(engine.model.tokenizer, prompt, chat=True)
    return [run(engine, ids, max_new_tokens) for run in DEMO_METHODS.values()], prompt
