"""ShareGPT streaming reader: truncated files, the deterministic split, chat rendering."""

import json

from conftest import char_tokenizer
from kvforge.data.sharegpt import Conversation, conversations, iter_json_array, render, split_of


def _write(tmp_path, items, cut=0):
    text = json.dumps(items, indent=2)
    path = tmp_path / "data.json"
    path.write_text(text[: len(text) - cut] if cut else text)
    return path


def test_whole_array_is_read(tmp_path):
    items = [{"id": str(i), "x": "y" * i} for i in range(50)]
    assert list(iter_json_array(_write(tmp_path, items), block=64)) == items


def test_truncated_array_stops_at_the_break(tmp_path):
    items = [{"id": str(i), "x": "y" * 30} for i in range(20)]
    got = list(iter_json_array(_write(tmp_path, items, cut=25), block=32))
    assert got == items[: len(got)] and 15 <= len(got) < 20


def test_split_is_deterministic_and_about_ten_percent():
    ids = [f"conv_{i}" for i in range(5000)]
    held = [i for i in ids if split_of(i) == "held_out"]
    assert held == [i for i in ids if split_of(i) == "held_out"]
    assert 400 < len(held) < 600


def test_conversations_map_roles_and_filter_splits(tmp_path):
    items = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
        for i in range(40)
    ] + [{"id": "short", "conversations": [{"from": "human", "value": "alone"}]}]
    path = _write(tmp_path, items)
    every = list(conversations(path=path))
    assert len(every) == 40 and every[0].turns == (("user", "hi"), ("assistant", "hello"))
    held = list(conversations("held_out", path=path))
    assert all(c.split == "held_out" for c in held)
    assert len(held) + len(list(conversations("fit", path=path))) == 40


def test_packaged_file_streams():
    first = []
    for conv in conversations():
        first.append(conv)
        if len(first) == 20:
            break
    assert len(first) == 20 and all(len(c.turns) >= 2 for c in first)


def test_render_without_a_chat_template_uses_role_lines():
    conv = Conversation("x", (("user", "hi"), ("assistant", "hello")))
    assert render(char_tokenizer(), conv, add_generation_prompt=True) == "User: hi\n\nAssistant: hello\n\nAssistant:"
