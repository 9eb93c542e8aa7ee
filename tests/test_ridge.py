"""ridge.py against numpy least squares and closed-form ridge."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.ridge import Moments, pick_lambda, r2, r2_pooled, solve


def _data(n=400, i=6, o=3, noise=0.1, seed=0):
    g = np.random.default_rng(seed)
    x = g.normal(size=(n, i)) * g.uniform(0.5, 3.0, size=i) + g.normal(size=i)
    w = g.normal(size=(i, o))
    b = g.normal(size=o)
    y = x @ w + b + noise * g.normal(size=(n, o))
    return x, y


def _moments(x, y, batches=1):
    m = Moments.zeros(x.shape[1], y.shape[1])
    for xs, ys in zip(np.array_split(x, batches), np.array_split(y, batches)):
        m.update(torch.tensor(xs, dtype=torch.float32), torch.tensor(ys, dtype=torch.float32))
    return m


@settings(max_examples=20, deadline=None)
@given(batches=st.integers(1, 7), seed=st.integers(0, 1000))
def test_unregularised_solve_equals_numpy_lstsq(batches, seed):
    x, y = _data(seed=seed)
    x32, y32 = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    w, b = solve(_moments(x, y, batches), lam=0.0)
    design = np.hstack([x32, np.ones((len(x32), 1))])
    ref, *_ = np.linalg.lstsq(design, y32, rcond=None)
    assert np.allclose(w.numpy(), ref[:-1], atol=1e-6)
    assert np.allclose(b.numpy(), ref[-1], atol=1e-6)


def test_ridge_matches_the_closed_form_on_centred_data():
    x, y = _data(n=200)
    x, y = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    lam = 0.3
    w, b = solve(_moments(x, y), lam=lam)
    xc, yc = x - x.mean(0), y - y.mean(0)
    cov = xc.T @ xc / len(x)
    ref = np.linalg.solve(cov + lam * np.trace(cov) / len(cov) * np.eye(len(cov)), xc.T @ yc / len(x))
    assert np.allclose(w.numpy(), ref, atol=1e-8)
    assert np.allclose(b.numpy(), y.mean(0) - x.mean(0) @ ref, atol=1e-8)


def test_r2_from_moments_equals_r2_from_rows():
    x, y = _data(seed=3)
    xh, yh = _data(seed=4)
    w, b = solve(_moments(x, y), lam=0.01)
    xh32 = xh.astype(np.float32).astype(np.float64)
    yh32 = yh.astype(np.float32).astype(np.float64)
    pred = xh32 @ w.numpy() + b.numpy()
    ref = 1 - ((yh32 - pred) ** 2).sum(0) / ((yh32 - yh32.mean(0)) ** 2).sum(0)
    assert np.allclose(r2(_moments(xh, yh), w, b).numpy(), ref, atol=1e-8)


def test_pooled_r2_weights_outputs_by_their_variance():
    x, y = _data(o=4, seed=5)
    y[:, 2:] *= 10.0  # the second group's outputs carry far more variance
    w, b = solve(_moments(x, y), lam=0.01)
    y32 = y.astype(np.float32).astype(np.float64)
    pred = x.astype(np.float32).astype(np.float64) @ w.numpy() + b.numpy()
    sse, sst = ((y32 - pred) ** 2).sum(0), ((y32 - y32.mean(0)) ** 2).sum(0)
    ref = [1 - sse[:2].sum() / sst[:2].sum(), 1 - sse[2:].sum() / sst[2:].sum()]
    assert np.allclose(r2_pooled(_moments(x, y), w, b, groups=2).numpy(), ref, atol=1e-8)


def test_rank_deficient_inputs_are_solved_on_their_subspace():
    x, y = _data(n=300, i=4)
    x = np.hstack([x, x[:, :1] * 2.0])  # a duplicated direction
    w, b = solve(_moments(x, y), lam=0.0, rel_tol=1e-6)
    assert torch.isfinite(w).all()
    assert r2(_moments(x, y), w, b).min() > 0.95


def test_pick_lambda_prefers_little_ridge_on_clean_data():
    x, y = _data(n=2500, noise=0.01)
    choice = pick_lambda(_moments(x[:2000], y[:2000]), _moments(x[2000:], y[2000:]), [0.0, 1e-3, 1.0, 10.0])
    (best,) = choice.lam
    assert best in (0.0, 1e-3) and choice.scores[10.0][0] < choice.scores[best][0] == choice.r2[0]
    w, b = solve(_moments(x[:2000], y[:2000]), best)
    torch.testing.assert_close(choice.w, w, atol=0, rtol=0)
    torch.testing.assert_close(choice.b, b, atol=0, rtol=0)


def test_pick_lambda_chooses_per_group_and_assembles_each_groups_map_at_its_lambda():
    # Group 0 is clean, group 1 pure noise over few rows: the noisy group wants a large λ.
    g = np.random.default_rng(7)
    x = g.normal(size=(60, 12))
    y = np.hstack([x[:, :2] @ g.normal(size=(2, 2)) + 0.01 * g.normal(size=(60, 2)), g.normal(size=(60, 2))])
    fit, held = _moments(x[:30], y[:30]), _moments(x[30:], y[30:])
    candidates = [0.0, 1e-2, 10.0, 1e3]
    choice = pick_lambda(fit, held, candidates, groups=2)
    assert choice.lam[0] < choice.lam[1]
    for group, lam in enumerate(choice.lam):
        cols = slice(2 * group, 2 * group + 2)
        w, b = solve(fit, lam)
        torch.testing.assert_close(choice.w[:, cols], w[:, cols], atol=0, rtol=0)
        torch.testing.assert_close(choice.b[cols], b[cols], atol=0, rtol=0)
        assert choice.r2[group] == max(choice.scores[c][group] for c in candidates)
        sub = held.select(torch.arange(12), torch.arange(2 * group, 2 * group + 2))
        torch.testing.assert_close(r2_pooled(sub, choice.w[:, cols], choice.b[cols]), torch.tensor([choice.r2[group]], dtype=torch.float64))


def test_a_single_candidate_is_a_fixed_lambda_still_scored():
    x, y = _data(n=500)
    choice = pick_lambda(_moments(x[:400], y[:400]), _moments(x[400:], y[400:]), [0.5], groups=3)
    assert choice.lam == [0.5] * 3 and list(choice.scores) == [0.5] and all(-1 < r <= 1 for r in choice.r2)
    with pytest.raises(ValueError):
        pick_lambda(_moments(x, y), _moments(x, y), [])


def test_mismatched_rows_and_negative_lambda_are_errors():
    m = Moments.zeros(2, 1)
    with pytest.raises(ValueError):
        m.update(torch.zeros(3, 2), torch.zeros(2, 1))
    with pytest.raises(ValueError):
        solve(_moments(*_data()), lam=-1.0)
