"""ShareGPT streaming reader: truncated files, the deterministic split, chat rendering."""

import json

from conftest import char_tokenizer
import pytest

from kvforge.data.sharegpt import Conversation, base_id, conversations, iter_json_array, render, split_of, text_digest


@pytest.fixture(autouse=True)
def _own_home(tmp_path, monkeypatch):
    """The split's per-file answer is cached under $KVFORGE_HOME: keep the fixtures' out of the user's."""
    monkeypatch.setenv("KVFORGE_HOME", str(tmp_path / "home"))


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


def test_split_is_by_base_id_and_about_ten_percent():
    bases = [f"conv{i}" for i in range(5000)]
    held = [b for b in bases if split_of(b) == "held_out"]
    assert 400 < len(held) < 600
    # every chunk of a conversation is on its base's side
    assert all(split_of(f"{b}_{j}") == split_of(b) for b in bases[:500] for j in range(6))
    assert base_id("QWJhYvA_12") == "QWJhYvA" and base_id("a_b_3") == "a_b" and base_id("plain") == "plain"


def _assert_no_leak(convs):
    sides: dict[str, set[str]] = {}
    texts: dict[str, set[str]] = {}
    for c in convs:
        sides.setdefault(base_id(c.id), set()).add(c.split)
        texts.setdefault(text_digest(c.turns), set()).add(c.split)
    assert all(len(s) == 1 for s in sides.values()), "a base conversation has chunks on both sides"
    assert all(len(s) == 1 for s in texts.values()), "a chunk text is on both sides"
    return sides


def test_chunks_and_copied_texts_never_straddle_the_split(tmp_path):
    """Chunks of one conversation share a side, and a held-out chunk whose text is byte-identical
    to a fit chunk's moves to fit (the two leaks the old whole-id split had)."""
    turns = lambda text: [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]
    items = [{"id": f"c{i}_{j}", "conversations": turns(f"chunk {j} of {i}")} for i in range(60) for j in range(4)]
    items += [{"id": f"copy{i}_0", "conversations": turns("the same text everywhere")} for i in range(60)]
    path = _write(tmp_path, items)
    every = list(conversations(path=path))
    sides = _assert_no_leak(every)
    assert {"fit"} in sides.values() and {"held_out"} in sides.values()
    copies = [c for c in every if c.id.startswith("copy")]
    assert any(split_of(c.id) == "held_out" for c in copies), "the fixture must hold a copy whose base is held out"
    assert all(c.split == "fit" for c in copies)
    held = list(conversations("held_out", path=path))
    assert held and all(c.split == "held_out" and not c.id.startswith("copy") for c in held)


@pytest.mark.slow
def test_packaged_file_has_no_leak():
    _assert_no_leak(conversations())


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
