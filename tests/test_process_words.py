"""The repository speaks of the software alone: no tracked text file tells how it was built.

A reader outside the project cannot resolve "the third session", "issue 16", "this machine" or
"now": a figure says what ran, on which CPU, from which command. The patterns are phrases, not
bare words, so `translate/session.py`, a variable called `now` and "a requests session" pass.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = (".md", ".py", ".json", ".toml", ".txt", ".c", ".cfg", ".yml", ".yaml", ".sh")
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    r"fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\w+|\d+(?:st|nd|rd|th)"
)
PROCESS_PHRASES = [
    rf"\b(?:{ORDINALS}) sessions?\b",
    r"\b(?:this|that|previous|earlier|later|last|next|same|another|a later|an earlier) sessions?\b",
    r"\b(?:this|that|previous|earlier|later|last|next) rounds?\b",
    r"\bissues? #?\d+",
    r"\b(?:a|an|the|independent|code) reviews?\b",
    r"\breviewers?\b",
    r"\b(?:this|that|earlier|previous|later|these|those) machines?\b",
    r"\bthe (?:AMX|EPYC|AVX2|AVX-512|AVX512) machine\b",
    r"\b(?:previous|earlier|old|older|newer|latest) engine\b",
    r"\btoday\b",
    r"\b(?:is|are|was|were|runs|reads|takes|gives|has|have) now\b",
    r"\bnow (?:runs|reads|takes|gives|has|have|are|is (?!None))",
    r"\bnot re-run\b",
    r"\bfor the record\b",
]
# Prose (Markdown) has no variables: there "now" is always a time word.
PROSE_ONLY = [r"\bnow\b"]


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    keep = [ROOT / name for name in listed if name.endswith(TEXT_SUFFIXES) or name == "Makefile"]
    return [path for path in keep if path.is_file() and path.name != Path(__file__).name]


def process_word_hits(text: str, prose: bool) -> list[tuple[int, str]]:
    patterns = [re.compile(p, re.IGNORECASE) for p in PROCESS_PHRASES + (PROSE_ONLY if prose else [])]
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if any(p.search(line) for p in patterns)]


@pytest.mark.parametrize(
    "line, caught",
    [
        ("measured in the twenty-first session", True),
        ("on the AMX machine of the 22nd session", True),
        ("as issue 16 asked", True),
        ("earlier machines ran it at 2x", True),
        ("the previous engine gave 3.1x", True),
        ("it is now 40 % faster", True),
        ("after a review of the change", True),
        ("from kvforge.translate.session import Session", False),
        ("now = time.perf_counter() if now is None else now", False),
        ("a multi-turn session alternates the models", False),
        ("Intel Xeon (AMX-BF16), 1 thread, bench peers", False),
    ],
)
def test_the_patterns_catch_process_words_and_spare_code(line, caught):
    assert bool(process_word_hits(line, prose=False)) is caught


def test_prose_bans_now_as_a_time_word():
    assert process_word_hits("The rescue is the default now.", prose=True)
    assert not process_word_hits("now = time.perf_counter()", prose=False)  # code keeps its variable
    assert not process_word_hits("known to work", prose=True)


def test_no_tracked_text_speaks_of_how_it_was_built():
    hits = []
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        hits += [f"{path.relative_to(ROOT)}:{n}: {line[:120]}" for n, line in process_word_hits(text, prose=path.suffix == ".md")]
    assert not hits, f"{len(hits)} lines speak of how the project was built:\n" + "\n".join(hits[:40])
