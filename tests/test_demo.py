"""The checks a demo answer must pass, on answers the demo has produced when it went wrong."""

import pytest

from kvforge.demo import DemoRow, closing_lines, degeneration, shared_content_words


@pytest.mark.parametrize(
    "answer, repeated",
    [
        ("Shuttle Shuttle Shuttle Shuttle Shuttle", "shuttle"),
        ("the conversation between the two speakers " * 6, "the conversation between the two speakers"),
        ("It is a loop, a loop, a loop, a loop.", "a loop"),
        ("The user asks for a Python script; the assistant writes one and explains each step.", None),
        ("no no no, three times is allowed", None),
        ("", None),
    ],
)
def test_degeneration_finds_a_word_or_phrase_repeated_four_times_in_a_row(answer, repeated):
    assert degeneration(answer) == repeated


def test_shared_content_words_ignore_stopwords_and_case():
    assert shared_content_words("The user wants Python code for sorting.", "Sorting lists in python") == {"python", "sorting"}
    assert shared_content_words("The user and the assistant talk.", "The conversation is about the user") == set()


def test_closing_lines_give_each_methods_ratio_to_exact():
    rows = [
        DemoRow("exact", 2000, 4.0, 10.0, "a"),
        DemoRow("ridgefill (split 15/30)", 2000, 2.0, 10.0, "b"),
        DemoRow("ngram drafting", 2000, 4.0, 30.0, "c", "extract", {"plain_tokens_per_s": 10.0, "same_tokens": True}),
        DemoRow("ngram drafting", 2000, 4.0, 5.0, "c", "extract", {"plain_tokens_per_s": 10.0, "same_tokens": False}),
    ]
    lines = closing_lines(rows)
    assert "TTFT 2.00x exact" in lines[1] and "docs/results.md#ridgefill" in lines[1]
    assert "3.00x plain" in lines[2] and "drafting paid" in lines[2] and "same tokens" in lines[2]
    assert "0.50x plain" in lines[3] and "did not pay" in lines[3] and "TOKENS DIFFER" in lines[3]
