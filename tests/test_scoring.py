"""Teacher-forced scoring (`kvforge.scoring`): one forward over a cache, or a whole sequence under
a plan, both equal to the exact model's own logits at their degenerate settings."""

import torch

from conftest import tiny_loaded
from kvforge.engine import Engine
from kvforge.plan import PrefillPlan
from kvforge.scoring import continuation_logits, continuation_nll, planned_nll, token_nll

IDS = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(0)).tolist()
PREFIX = 25


def test_continuation_over_an_exact_cache_equals_the_full_forward(family):
    engine = Engine(tiny_loaded(family))
    full, _ = engine.prefill([IDS], logits="all")  # (1, N, V)
    _, cache = engine.prefill([IDS[: PREFIX - 1]], logits="none")
    with torch.inference_mode():
        logits = continuation_logits(engine, IDS, PREFIX, cache)
    torch.testing.assert_close(logits, full[0, PREFIX - 1 : -1], atol=1e-4, rtol=1e-4)
    assert cache.lengths() == [len(IDS) - 1] * engine.num_layers  # the continuation's rows stay


def test_restore_leaves_a_shared_cache_as_it_was():
    engine = Engine(tiny_loaded("llama"))
    _, cache = engine.prefill([IDS[: PREFIX - 1]], logits="none")
    keys = [layer.keys().clone() for layer in cache.layers]
    with torch.inference_mode():
        first = continuation_nll(engine, IDS, PREFIX, cache, restore=True)
        second = continuation_nll(engine, IDS, PREFIX, cache, restore=True)
    assert cache.lengths() == [PREFIX - 1] * engine.num_layers
    assert all(torch.equal(a, layer.keys()) for a, layer in zip(keys, cache.layers))
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_the_exact_plan_scores_like_the_continuation_and_both_agree_with_cross_entropy():
    engine = Engine(tiny_loaded("qwen3"))
    full, _ = engine.prefill([IDS], logits="all")
    reference = torch.nn.functional.cross_entropy(full[0, PREFIX - 1 : -1], torch.tensor(IDS[PREFIX:]), reduction="none")
    _, cache = engine.prefill([IDS[: PREFIX - 1]], logits="none")
    with torch.inference_mode():
        over_cache = continuation_nll(engine, IDS, PREFIX, cache)
        planned = planned_nll(engine, IDS, PREFIX, PrefillPlan.exact(len(IDS), engine.num_layers))
    assert over_cache.shape == planned.shape == (len(IDS) - PREFIX,)
    torch.testing.assert_close(over_cache, reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(planned, reference, atol=1e-4, rtol=1e-4)


def test_scoring_is_differentiable_outside_inference_mode():
    engine = Engine(tiny_loaded("llama"))
    weight = engine.model.hf.get_input_embeddings().weight
    weight.grad = None
    planned_nll(engine, IDS, PREFIX, PrefillPlan.exact(len(IDS), engine.num_layers)).mean().backward()
    assert weight.grad is not None and float(weight.grad.abs().sum()) > 0
    weight.grad = None


def test_token_nll_is_the_per_token_cross_entropy():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    expected = torch.tensor([torch.logsumexp(logits[0], 0) - 1.0, torch.logsumexp(logits[1], 0) - 3.0])
    torch.testing.assert_close(token_nll(logits, [1, 0]), expected)
