"""The shared optimisation loop (`kvforge.training`): its schedule as a table, its step against
the hand-written loop it replaced, and a weights-only checkpoint that resumes bit for bit."""

import io
import math

import pytest
import torch

from kvforge.training import OptimConfig, Trainer, warmup_cosine


@pytest.mark.parametrize(
    "step, expected",
    [(0, 0.5), (1, 1.0), (2, 1.0), (6, 0.5), (10, 0.0), (12, 0.0)],
)
def test_warmup_then_half_a_cosine(step, expected):
    assert math.isclose(warmup_cosine(step, warmup=2, total=10), expected, abs_tol=1e-12)


def test_warmup_is_a_fraction_of_the_steps_and_at_least_one():
    assert OptimConfig(1e-3, 200).warmup == 10 and OptimConfig(1e-3, 5).warmup == 1
    with pytest.raises(ValueError):
        OptimConfig(0.0, 10)
    with pytest.raises(ValueError):
        OptimConfig(1e-3, 10, accumulate=0)


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)
    w = torch.nn.Parameter(torch.randn(4, 3, generator=g))
    return x, y, w


def _loss(x, y, w, j):
    return ((x[2 * j : 2 * j + 2] @ w - y[2 * j : 2 * j + 2]) ** 2).mean() * 50  # large: clipping bites


def test_a_step_equals_the_hand_written_loop_it_replaced():
    x, y, w = _problem()
    trainer = Trainer([w], OptimConfig(lr=0.1, steps=5, warmup_fraction=0.2, accumulate=3))
    ours = [trainer.step(lambda j: _loss(x, y, w, j)) for _ in range(5)]

    _, _, ref = _problem()  # the loop SPEED fitting and stage 2 each had
    optimizer = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, 1, 5))
    theirs = []
    for _ in range(5):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(3):
            loss = _loss(x, y, ref, j) / 3
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_([ref], 1.0)
        optimizer.step()
        schedule.step()
        theirs.append(total)
    assert ours == theirs
    torch.testing.assert_close(w, ref, atol=0, rtol=0)


def test_state_resumes_bit_for_bit_through_a_weights_only_load():
    config = OptimConfig(lr=0.05, steps=6, accumulate=2)
    x, y, w = _problem(1)
    straight = Trainer([w], config)
    for _ in range(6):
        straight.step(lambda j: _loss(x, y, w, j))

    _, _, v = _problem(1)
    first = Trainer([v], config)
    for _ in range(3):
        first.step(lambda j: _loss(x, y, v, j))
    buffer = io.BytesIO()
    torch.save({"w": v.detach().clone(), "trainer": first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    _, _, u = _problem(1)
    with torch.no_grad():
        u.copy_(saved["w"])
    second = Trainer([u], config)
    second.load_state_dict(saved["trainer"])
    for _ in range(3):
        second.step(lambda j: _loss(x, y, u, j))
    torch.testing.assert_close(u, w, atol=0, rtol=0)
