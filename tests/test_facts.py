"""Planted facts: the held-out QA set and the stage-2 recall samples never share a fact."""

import random

import pytest

from kvforge.data.facts import EVAL_FACTS, TRAINING_FACTS, plant, question_ending, recall_sample
from kvforge.evaluate.qa import qa_items
from kvforge.translate.samples import training_texts

TURNS = [("user", "How do I boil an egg?"), ("assistant", "Put it in boiling water for nine minutes."),
         ("user", "And a soft one?"), ("assistant", "Six minutes, then cold water.")]


def test_training_facts_share_no_template_or_value_with_the_qa_set():
    def words(facts, field):
        return {getattr(f, field).lower() for f in facts}

    assert not words(EVAL_FACTS, "statement") & words(TRAINING_FACTS, "statement")
    assert not words(EVAL_FACTS, "question") & words(TRAINING_FACTS, "question")
    held = {v.lower() for f in EVAL_FACTS for v in f.values}
    taught = {v.lower() for f in TRAINING_FACTS for v in f.values}
    assert not any(h in t or t in h for h in held for t in taught)


def test_a_planted_fact_opens_the_first_turn_and_is_asked_last():
    fact = TRAINING_FACTS[0]
    text = plant(TURNS, fact, "Rosie", 1000)
    assert text.startswith(f"User: {fact.statement.format('Rosie')} How do I boil") and text.endswith(question_ending(fact))
    assert "Six minutes" in text  # both exchanges fit
    assert "Six minutes" not in plant(TURNS, fact, "Rosie", 200)  # only the first one does
    assert plant(TURNS, fact, "Rosie", 100) is None  # not even that
    assert plant(TURNS[1:], fact, "Rosie", 1000) is None  # an assistant-first conversation


def test_a_recall_sample_answers_with_the_planted_value():
    for seed in range(20):
        text, cut = recall_sample(TURNS, random.Random(seed), 1000)
        fact = next(f for f in TRAINING_FACTS if f.question in text)
        value = next(v for v in fact.values if text[cut:] == " " + fact.reply.format(v))
        assert fact.statement.format(value) in text[:cut] and text[:cut].endswith("Assistant:")


def test_recall_samples_take_their_share_and_leave_the_old_mix_alone():
    mixed, _ = training_texts("fit", 8, 2000, 3000, 200, recall_fraction=0.5)
    asked = [t for t, cut in mixed if t[:cut].endswith("Answer in a few words.\n\nAssistant:")]
    assert len(asked) == 4 and all(any(f.question in t for f in TRAINING_FACTS) for t in asked)
    assert training_texts("fit", 6, 2000, 3000, 200) == training_texts("fit", 6, 2000, 3000, 200, recall_fraction=0.0)
    with pytest.raises(ValueError, match="fractions"):
        training_texts("fit", 2, 2000, 3000, 200, recall_fraction=1.0)


def test_the_qa_set_asks_only_held_out_facts():
    items = qa_items(10)
    assert all(any(f.question in item.text and f.statement.format(item.answer) in item.text for f in EVAL_FACTS) for item in items)
    assert [item.answer for item in items[:5]] == ["Biscuit", "Tbilisi", "ochre", "saffron", "522"]  # the set every QA figure was measured on



def test_a_bad_recall_fraction_is_refused_before_anything_loads():
    from kvforge.translate.distill import DistillConfig

    with pytest.raises(ValueError, match="recall-fraction"):
        DistillConfig(recall_fraction=1.0)
