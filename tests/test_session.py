"""Multi-turn alternated translation: each model keeps its own cache, a switch translates only the new tokens."""

import pytest
import torch

from conftest import tiny_loaded
from kvforge.cache import RowKind
from kvforge.engine import Engine
from kvforge.errors import PromptError
from kvforge.generation import GenerationConfig
from kvforge.translate.fit import LingoFitConfig, fit_lingo
from kvforge.translate.session import Conversation
from test_lingo import identity_translator

TURNS = [
    ("what are three colours?", "red, green and blue."),
    ("and two more?", "yellow and purple, say."),
    ("which is warmest?", "red is the warmest of them."),
    ("name a cold one.", "blue feels cold."),
]


def segments(conv: Conversation, i: int) -> tuple[str, str]:
    user, reply = TURNS[i]
    return conv.prompt_segment(user), " " + reply


def per_turn(conv: Conversation) -> list[float]:
    return [conv.score(*segments(conv, i))[0] for i in range(len(TURNS))]


@pytest.fixture(scope="module")
def pair():
    a, b = Engine(tiny_loaded("gemma3", seed=1)), Engine(tiny_loaded("llama", seed=2))
    config = LingoFitConfig(assign="depth", nu=1, conversations=2, max_chars=300)
    return (a, b), (fit_lingo(a, b, config), fit_lingo(b, a, config))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_with_exact_maps_every_mode_scores_like_the_native_reference(family):
    engine = Engine(tiny_loaded(family, seed=3))
    tr = identity_translator(engine, "pre-norm")
    reference = per_turn(Conversation((engine, engine), None, "native"))
    for mode in ("alternated", "naive"):
        torch.testing.assert_close(torch.tensor(per_turn(Conversation((engine, engine), (tr, tr), mode))), torch.tensor(reference),
                                   rtol=1e-4, atol=1e-4)


def test_alternated_translates_exactly_the_tokens_since_the_last_switch(pair):
    engines, translators = pair
    conv = Conversation(engines, translators, "alternated")
    for i in range(len(TURNS)):
        speaker = conv.parties[i % 2]
        seen = len(speaker.ends)
        old = None if speaker.cache is None else speaker.cache[0].keys()[:, :, : speaker.rows].clone()
        kinds_before = 0 if speaker.cache is None else int((speaker.cache[0].row_kinds() == RowKind.TRANSLATED).sum())
        conv.score(*segments(conv, i))
        if i == 0:
            assert conv.switches == []
            continue
        switch = conv.switches[-1]
        missed = speaker.ends[len(conv.segments) - 3] - (speaker.ends[seen - 1] if seen else 0)  # rows of the segments it missed
        assert switch.new_rows == missed
        other = conv.parties[1 - i % 2]
        assert switch.source_rows == other.ends[len(conv.segments) - 3] - (other.ends[seen - 1] if seen else 0)
        kinds_after = int((speaker.cache[0].row_kinds() == RowKind.TRANSLATED).sum())
        assert kinds_after - kinds_before == switch.translated_rows
        assert switch.translated_rows == missed - (conv_head(speaker) if not seen else 0)  # head rows only on an empty cache
        if old is not None:  # its earlier rows are left as they were
            torch.testing.assert_close(speaker.cache[0].keys()[:, :, : old.shape[2]], old, atol=0, rtol=0)


def conv_head(party) -> int:
    from kvforge.translate.align import head_rows

    return head_rows(party.stream(0, len(party.ids)))


def test_naive_retranslates_the_whole_prefix_at_every_switch(pair):
    engines, translators = pair
    conv = Conversation(engines, translators, "naive")
    for i in range(len(TURNS)):
        conv.score(*segments(conv, i))
        if i:
            speaker, other = conv.parties[i % 2], conv.parties[1 - i % 2]
            switch = conv.switches[-1]
            assert switch.source_rows == other.ends[len(conv.segments) - 3]
            prefix = speaker.ends[len(conv.segments) - 3]
            assert switch.translated_rows == prefix - conv_head(speaker)
            assert int((speaker.cache[0].row_kinds() == RowKind.TRANSLATED).sum()) == switch.translated_rows


def test_a_generated_conversation_keeps_each_cache_in_step_with_its_stream(pair):
    engines, translators = pair
    conv = Conversation(engines, translators, "alternated")
    config = GenerationConfig(max_new_tokens=5, temperature=0.0)
    for user in ("hi there", "tell me more", "and then?"):
        out = conv.respond(user, config)
        assert out.token_ids
    assert len(conv.segments) == 6 and len(conv.switches) == 2
    for party in conv.parties:
        assert 0 <= len(party.ids) - party.rows <= 1  # at most its last generated token pending
    with pytest.raises(PromptError, match="empty prompt"):
        conv.respond("  ", config)


def test_a_conversation_past_the_context_is_refused(pair):
    engines, translators = pair
    conv = Conversation(engines, translators, "alternated")
    limit = engines[0].model.context_length
    with pytest.raises(PromptError, match="context"):
        conv.score(conv.prompt_segment("x" * (limit + 10)), " y")


def test_modes_and_translators_are_checked(pair):
    engines, translators = pair
    with pytest.raises(ValueError, match="unknown mode"):
        Conversation(engines, translators, "relay")
    with pytest.raises(ValueError, match="needs a translator"):
        Conversation(engines, None, "alternated")
    with pytest.raises(Exception, match="other direction"):
        Conversation(engines, (translators[1], translators[0]), "alternated")


def test_own_token_translators_read_each_switchs_rows_at_their_place():
    # Layer-0 values are linear in the target's own token embedding, which an own-token
    # translator reads: a switch mid-conversation must hand it the ids of exactly the rows it
    # translates (a shifted id would leave the rows far off).
    a, b = Engine(tiny_loaded("gemma3", seed=1)), Engine(tiny_loaded("llama", seed=2))
    config = LingoFitConfig(assign="depth", nu=1, conversations=3, max_chars=300, own_tokens=1)
    conv = Conversation((a, b), (fit_lingo(a, b, config), fit_lingo(b, a, config)), "alternated")
    for i in range(len(TURNS)):
        conv.score(*segments(conv, i))
    assert len(conv.switches) == 3
    for party in conv.parties:
        _, exact = party.engine.prefill([party.ids[: party.rows]])
        translated = party.cache[0].row_kinds()[0] == RowKind.TRANSLATED
        error = (party.cache[0].values() - exact[0].values())[0].norm(dim=(0, 2))[translated]
        # median: a character the fit texts never held gets no own-token term (outside their span)
        assert translated.sum() > 10 and float(error.median()) < 1e-4 * float(exact[0].values().norm(dim=(1, 3)).mean())
