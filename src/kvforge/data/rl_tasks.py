"""RL tasks generated on the spot (no downloads), each with a training and a held-out split and a
reward with partial credit, so a small model's groups are rarely all zero (a group whose rewards
are all equal has no advantage and teaches nothing).

- **sql**: text-to-SQL on generated schemas, the setting NgramRL's source measured (Spider). A
  table takes a name and columns from a vocabulary and random rows; a question from a template
  comes with its gold query. A completion's first SELECT statement is executed in sqlite3 beside
  the gold one: 0.2 when it runs, +0.2 when it reads the right table, +0.2 when it names the
  question's columns, 1.0 when its result equals the gold result.
- **arith**: arithmetic word problems of one to three steps with a required last line
  `Answer: <number>`: 0.1 when the answer appears anywhere, +0.2 for that line, 1.0 when its
  number is the answer.

A problem is a function of (task, split, index): the training split draws from seeds 0, 1, ...,
the held-out split from a disjoint range, so held-out problems are never trained on.
"""

from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass, field

HELD_OUT_OFFSET = 1_000_000  # held-out problems' seeds start here
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Problem:
    task: str
    key: str  # names the problem (its rollout key): task, split and index
    prompt: str  # the user message
    answer: str  # the gold query, or the number
    schema: tuple = field(default=(), repr=False)  # sql: the table's DDL and rows


# --- text-to-SQL -------------------------------------------------------------------------------
TABLES = {
    "employees": [("name", "TEXT"), ("department", "TEXT"), ("salary", "INTEGER"), ("age", "INTEGER"), ("city", "TEXT")],
    "products": [("name", "TEXT"), ("category", "TEXT"), ("price", "INTEGER"), ("stock", "INTEGER"), ("brand", "TEXT")],
    "students": [("name", "TEXT"), ("major", "TEXT"), ("score", "INTEGER"), ("age", "INTEGER"), ("city", "TEXT")],
    "books": [("title", "TEXT"), ("genre", "TEXT"), ("pages", "INTEGER"), ("year", "INTEGER"), ("author", "TEXT")],
    "cars": [("model", "TEXT"), ("maker", "TEXT"), ("price", "INTEGER"), ("year", "INTEGER"), ("color", "TEXT")],
}
WORDS = ("red", "blue", "north", "south", "alpha", "beta", "green", "west", "east", "gold", "silver", "oak")
QUESTIONS = (  # (question, gold query, the columns it names)
    ("List the {a} of every row in {t}.", "SELECT {a} FROM {t};", ("a",)),
    ("How many rows of {t} have {n} greater than {v}?", "SELECT COUNT(*) FROM {t} WHERE {n} > {v};", ("n",)),
    ("What is the average {n} in {t}?", "SELECT AVG({n}) FROM {t};", ("n",)),
    ("What is the largest {n} in {t}?", "SELECT MAX({n}) FROM {t};", ("n",)),
    ("List the {a} of the rows in {t} whose {b} is '{w}'.", "SELECT {a} FROM {t} WHERE {b} = '{w}';", ("a", "b")),
    ("List the {a} of the rows in {t} with {n} below {v}.", "SELECT {a} FROM {t} WHERE {n} < {v};", ("a", "n")),
)


def _sql_problem(split: str, index: int) -> Problem:
    rng = random.Random(index + (HELD_OUT_OFFSET if split == "heldout" else 0))
    table = rng.choice(sorted(TABLES))
    columns = rng.sample(TABLES[table], 4)
    texts = [c for c, kind in columns if kind == "TEXT"] or [columns[0][0]]
    numbers = [c for c, kind in columns if kind == "INTEGER"] or [columns[-1][0]]
    rows = [tuple(rng.choice(WORDS) if kind == "TEXT" else rng.randint(1, 100) for _, kind in columns) for _ in range(12)]
    question, gold, named = rng.choice(QUESTIONS)
    fill = {"t": table, "a": rng.choice(texts), "b": rng.choice(texts), "n": rng.choice(numbers), "v": rng.randint(20, 80),
            "w": rng.choice(WORDS)}
    ddl = f"CREATE TABLE {table} (" + ", ".join(f"{c} {kind}" for c, kind in columns) + ");"
    prompt = ("Write one SQLite query that answers the question. Reply with the query only, on one line.\n\n"
              "Example schema: CREATE TABLE pets (name TEXT, kind TEXT, age INTEGER);\n"
              "Example question: What is the largest age in pets?\nQuery: SELECT MAX(age) FROM pets;\n\n"
              f"Schema: {ddl}\nQuestion: {question.format(**fill)}\nQuery:")
    answer = gold.format(**fill)
    needed = tuple(fill[n] for n in named)
    return Problem("sql", f"sql/{split}/{index}", prompt, answer, (ddl, tuple(rows), table, needed))


def _first_select(text: str) -> str | None:
    match = re.search(r"select\b[^;`]*;?", text, flags=re.IGNORECASE)
    return match.group(0).strip() if match else None


def _run_query(problem: Problem, query: str) -> list | None:
    ddl, rows, table, _ = problem.schema
    with sqlite3.connect(":memory:") as db:
        db.execute(ddl)
        db.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
        try:
            return sorted(db.execute(query).fetchall(), key=repr)
        except sqlite3.Error:
            return None


def sql_reward(problem: Problem, completion: str) -> float:
    query = _first_select(completion)
    if query is None:
        return 0.0
    got = _run_query(problem, query)
    if got is None:
        return 0.0
    if got == _run_query(problem, problem.answer):
        return 1.0
    _, _, table, needed = problem.schema
    words = set(re.findall(r"\w+", query.lower()))
    return 0.2 + 0.2 * (table in words) + 0.2 * all(c in words for c in needed)


# --- arithmetic word problems ------------------------------------------------------------------
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils")
STEPS = (  # (sentence, operation on the running count)
    ("{name} buys {x} more {item}.", lambda c, x: c + x),
    ("{name} gives {x} {item} to a friend.", lambda c, x: c - x),
    ("{name} finds {x} more {item}.", lambda c, x: c + x),
    ("Then the number of {item} {name} has doubles.", lambda c, x: 2 * c),
)


def _arith_problem(split: str, index: int) -> Problem:
    rng = random.Random(index + (HELD_OUT_OFFSET if split == "heldout" else 0))
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(5, 30)
    sentences = [f"{name} has {count} {item}."]
    for _ in range(rng.randint(1, 3)):
        sentence, apply = rng.choice(STEPS)
        x = rng.randint(1, min(9, max(1, count - 1)))
        sentences.append(sentence.format(name=name, x=x, item=item))
        count = apply(count, x)
    prompt = ("Solve the problem step by step, then end with a last line of the form `Answer: <number>`.\n\n"
              "Example: Ben has 4 coins. Ben finds 3 more coins. How many coins does Ben have in the end?\n"
              "Ben has 4 coins. He finds 3 more: 4 + 3 = 7.\nAnswer: 7\n\n"
              + " ".join(sentences) + f" How many {item} does {name} have in the end?")
    return Problem("arith", f"arith/{split}/{index}", prompt, str(count))


def arith_reward(problem: Problem, completion: str) -> float:
    lines = re.findall(r"answer:\s*(-?\d+)", completion, flags=re.IGNORECASE)
    if lines and lines[-1] == problem.answer:
        return 1.0
    mentioned = problem.answer in re.findall(r"-?\d+", completion)
    return 0.1 * mentioned + 0.2 * bool(lines)


TASKS = {"sql": (_sql_problem, sql_reward), "arith": (_arith_problem, arith_reward)}


def problems(task: str, split: str, count: int, start: int = 0) -> list[Problem]:
    """`count` problems of `task` from `split`, indices start, start + 1, ..."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: use {' or '.join(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use {' or '.join(SPLITS)}")
    return [TASKS[task][0](split, start + i) for i in range(count)]


def reward(problem: Problem, completion: str) -> float:
    """The completion's reward in [0, 1] (the module docstring gives the credits)."""
    return TASKS[problem.task][1](problem, completion)
