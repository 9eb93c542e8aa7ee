"""Planted facts: an arbitrary fact stated in a conversation's first user turn and asked as its
last one, so the answer can only come from the conversation (a model's memory cannot supply it).

Two disjoint sets: `EVAL_FACTS` (the held-out QA set of `eval lingo`) and `TRAINING_FACTS`
(stage-2 recall samples). They share no template and no value, so what training on recall
teaches is measured on facts it never saw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvforge.data.prompts import plain_text


@dataclass(frozen=True)
class Fact:
    statement: str  # with one {} for the value
    question: str
    values: tuple[str, ...]
    reply: str = ""  # the answer as a sentence, with one {}: the continuation of a training sample


EVAL_FACTS = (
    Fact("My cat is called {}.", "What is my cat called?",
         ("Biscuit", "Marigold", "Tobias", "Winnie", "Pepper", "Juniper", "Oscar", "Clementine", "Rufus", "Hazel")),
    Fact("I was born in {}.", "In which city was I born?",
         ("Lisbon", "Nairobi", "Oslo", "Montreal", "Kyoto", "Valparaiso", "Krakow", "Adelaide", "Tbilisi", "Quito")),
    Fact("My favourite colour is {}.", "What is my favourite colour?",
         ("turquoise", "maroon", "lavender", "olive", "amber", "crimson", "teal", "ochre", "indigo", "scarlet")),
    Fact("The password for the shared drive is {}.", "What is the password for the shared drive?",
         ("pelican", "lantern", "harvest", "copper", "meadow", "falcon", "saffron", "glacier", "orchid", "tundra")),
    Fact("Our team meeting is in room {}.", "Which room is our team meeting in?",
         tuple(str(n) for n in range(214, 994, 77))),
)

TRAINING_FACTS = (
    Fact("My dog's name is {}.", "What is my dog's name?",
         ("Rosie", "Bramble", "Ziggy", "Mabel", "Otis", "Nutmeg", "Pickles", "Waffles", "Dexter", "Poppy", "Archie", "Luna"), "Your dog's name is {}."),
    Fact("My sister lives in {}.", "Where does my sister live?",
         ("Porto", "Dakar", "Bergen", "Halifax", "Osaka", "Cusco", "Gdansk", "Perth", "Yerevan", "Bogota", "Seville", "Hanoi"), "Your sister lives in {}."),
    Fact("My favourite fruit is {}.", "What is my favourite fruit?",
         ("mango", "papaya", "lychee", "apricot", "plum", "kiwi", "guava", "fig", "cherry", "pomegranate"), "Your favourite fruit is {}."),
    Fact("My manager is called {}.", "What is my manager called?",
         ("Priya", "Anders", "Mateo", "Yuki", "Fatima", "Dmitri", "Leona", "Kwame", "Ingrid", "Rafael"), "Your manager is called {}."),
    Fact("The code for the garage door is {}.", "What is the code for the garage door?",
         ("1037", "2650", "3172", "4819", "5306", "6043", "7125", "8461", "9270", "1588"), "The code is {}."),
    Fact("The wifi network is called {}.", "What is the wifi network called?",
         ("Nebula", "Driftwood", "Kestrel", "Sundial", "Pinecone", "Zephyr", "Harbor", "Thistle", "Quasar", "Marmalade"), "It is called {}."),
    Fact("My car is {}.", "What colour is my car?",
         ("silver", "beige", "magenta", "charcoal", "mint green", "bronze", "navy blue", "coral"), "Your car is {}."),
    Fact("My flight leaves from gate {}.", "Which gate does my flight leave from?",
         ("B7", "C12", "A3", "D21", "E9", "F14", "G2", "H18"), "Gate {}."),
)


def question_ending(fact: Fact) -> str:
    return f"\n\nUser: {fact.question} Answer in a few words.\n\nAssistant:"


def plant(turns, fact: Fact, value: str, prefix_chars: int) -> str | None:
    """The conversation with `fact` stated before its first user turn, its whole exchanges that fit
    in `prefix_chars` with the question, and the question as the last user turn, ending with the
    assistant header; None when even the first exchange does not fit."""
    turns = list(turns)
    if len(turns) < 2 or turns[0][0] != "user":
        return None
    turns[0] = ("user", f"{fact.statement.format(value)} {turns[0][1].strip()}")
    ending = question_ending(fact)
    fits = [k for k in range(2, len(turns) + 1, 2)
            if turns[k - 1][0] == "assistant" and len(plain_text(turns[:k])) + len(ending) <= prefix_chars]
    return plain_text(turns[: max(fits)]) + ending if fits else None


def recall_sample(turns, rng: random.Random, prefix_chars: int) -> tuple[str, int] | None:
    """A stage-2 training sample (text, cut): a training fact planted in the conversation, asked at
    its end, the answer sentence as the continuation."""
    fact = rng.choice(TRAINING_FACTS)
    value = rng.choice(fact.values)
    prefix = plant(turns, fact, value, prefix_chars)
    return None if prefix is None else (prefix + " " + fact.reply.format(value), len(prefix))
