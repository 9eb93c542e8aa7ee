"""Quality metrics: token classes by n-gram, perplexity gap and its paired bootstrap interval."""

import math

import torch

from kvforge.evaluate.metrics import mean_nll, paired_bootstrap_ci, ppl_gap_pct, token_classes


def test_token_classes_by_trigram():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2]
    filled = torch.tensor([False, True, True, True, True, False, False, False])  # rows 1..4 filled
    novel, key = token_classes(tokens, scored_from=5, filled=filled)
    # trigrams ending at scored rows 5..9: (8,9,5) new, (9,5,6) new, (5,6,7) seen ending at row 2
    # (a filled row) -> key, (6,7,1) new, (7,1,2) new
    assert novel.tolist() == [True, True, False, True, True]
    assert key.tolist() == [False, False, True, False, False]


def test_gap_and_interval():
    exact = [torch.full((10,), 2.0, dtype=torch.float64), torch.full((10,), 2.0, dtype=torch.float64)]
    arm = [torch.full((10,), 2.1, dtype=torch.float64), torch.full((10,), 2.1, dtype=torch.float64)]
    masks = [torch.ones(10, dtype=torch.bool)] * 2
    assert math.isclose(mean_nll(arm, masks), 2.1)
    assert math.isclose(ppl_gap_pct(arm, exact, masks), 100 * (math.exp(0.1) - 1), rel_tol=1e-9)
    low, high = paired_bootstrap_ci(arm, exact, masks)
    assert math.isclose(low, high, rel_tol=1e-6) and math.isclose(low, 100 * (math.exp(0.1) - 1), rel_tol=1e-6)
    noisy = [torch.full((10,), 2.0, dtype=torch.float64), torch.full((10,), 2.4, dtype=torch.float64)]
    low, high = paired_bootstrap_ci(noisy, exact, masks)
    assert low < ppl_gap_pct(noisy, exact, masks) < high
