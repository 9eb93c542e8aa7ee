"""Closed-form ridge regression from streamed float64 moments (shared by RidgeFill and KV-Lingo).

Shapes: N rows, I input features, O outputs.

Data is seen once, in batches, and only its moments are kept: n, Σx, Σy, XᵀX, XᵀY and Σy²
per output. The fit centres them (so the map has a bias), eigendecomposes the input covariance
once, and solves W = Q (Λ + λ·mean(diag C))⁻¹ Qᵀ C_xy, treating eigenvalues below `rel_tol`
× the largest as zero (the pseudo-inverse on the well-determined subspace). λ is relative to the
covariance's mean diagonal, so one value means the same across layers of different scale.
Held-out R² per output comes from the held-out set's own moments, without its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE = torch.float64


@dataclass
class Moments:
    """Sufficient statistics of (x, y) pairs, accumulated in float64."""

    n: int
    sx: torch.Tensor  # (I,)
    sy: torch.Tensor  # (O,)
    xx: torch.Tensor  # (I, I)
    xy: torch.Tensor  # (I, O)
    yy: torch.Tensor  # (O,) Σ y² per output

    @classmethod
    def zeros(cls, inputs: int, outputs: int, device: torch.device | str = "cpu") -> "Moments":
        z = lambda *shape: torch.zeros(*shape, dtype=DTYPE, device=device)  # noqa: E731
        return cls(0, z(inputs), z(outputs), z(inputs, inputs), z(inputs, outputs), z(outputs))

    def update(self, x: torch.Tensor, y: torch.Tensor) -> "Moments":
        """Add rows x (N, I), y (N, O) in place; returns self."""
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
        x, y = x.to(DTYPE), y.to(DTYPE)
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.xx += x.T @ x
        self.xy += x.T @ y
        self.yy += (y * y).sum(0)
        return self

    def __add__(self, other: "Moments") -> "Moments":
        return Moments(
            self.n + other.n, self.sx + other.sx, self.sy + other.sy, self.xx + other.xx, self.xy + other.xy, self.yy + other.yy
        )

    def select(self, inputs: torch.Tensor, outputs: torch.Tensor) -> "Moments":
        """The moments of a sub-problem: the chosen input and output features (index tensors).
        A fit over many candidate inputs accumulates once and solves any subset (KV-Lingo's
        layer assignments)."""
        return Moments(
            self.n, self.sx[inputs], self.sy[outputs], self.xx[inputs][:, inputs], self.xy[inputs][:, outputs], self.yy[outputs]
        )

    def centred(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean x, mean y, cov x (I, I), cov xy (I, O)), population normalisation."""
        if self.n == 0:
            raise ValueError("no rows accumulated")
        mx, my = self.sx / self.n, self.sy / self.n
        cxx = self.xx / self.n - torch.outer(mx, mx)
        cxy = self.xy / self.n - torch.outer(mx, my)
        return mx, my, cxx, cxy


@dataclass
class Eigen:
    """The input covariance's eigendecomposition, computed once and reused across λ."""

    values: torch.Tensor  # (I,)
    vectors: torch.Tensor  # (I, I)
    mean_diag: float


def eigen(moments: Moments) -> Eigen:
    _, _, cxx, _ = moments.centred()
    values, vectors = torch.linalg.eigh(cxx)
    return Eigen(values, vectors, float(cxx.diagonal().mean()))


def solve(
    moments: Moments, lam: float = 0.0, rel_tol: float = 1e-8, decomposition: Eigen | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge map with bias: y ≈ x @ W + b. Returns W (I, O), b (O,) in float64.

    lam: ridge strength relative to the mean diagonal of cov(x); eigenvalues below rel_tol × the
    largest are treated as zero.
    """
    if lam < 0 or rel_tol < 0:
        raise ValueError(f"lam and rel_tol must be >= 0, got {lam}, {rel_tol}")
    mx, my, _, cxy = moments.centred()
    e = decomposition or eigen(moments)
    keep = e.values > rel_tol * e.values.max().clamp(min=0)
    inv = torch.where(keep, 1.0 / (e.values + lam * e.mean_diag).clamp(min=torch.finfo(DTYPE).tiny), 0.0)
    w = e.vectors @ (inv.unsqueeze(1) * (e.vectors.T @ cxy))
    b = my - mx @ w
    return w, b


def residuals(moments: Moments, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O,) sums of squared error of y ≈ x @ w + b and (O,) total sums of squares about the mean,
    on the data behind `moments`. Expands Σ (y - xw - b)² in the moments, so held-out data need
    not be kept."""
    w, b = w.to(DTYPE), b.to(DTYPE)
    n = moments.n
    sse = (
        moments.yy
        - 2 * (moments.xy * w).sum(0)
        - 2 * b * moments.sy
        + ((moments.xx @ w) * w).sum(0)
        + 2 * b * (moments.sx @ w)
        + n * b * b
    )
    return sse, moments.yy - moments.sy**2 / n


def r2(moments: Moments, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(O,) coefficient of determination of y ≈ x @ w + b, per output."""
    sse, sst = residuals(moments, w, b)
    return 1.0 - sse / sst.clamp(min=torch.finfo(DTYPE).tiny)


def r2_pooled(moments: Moments, w: torch.Tensor, b: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """(groups,) variance-weighted R² (1 - ΣSSE / ΣSST) of each of `groups` equal blocks of outputs:
    the share of a predicted vector's variance the map explains (a layer's input, for RidgeFill)."""
    sse, sst = residuals(moments, w, b)
    return 1.0 - sse.view(groups, -1).sum(1) / sst.view(groups, -1).sum(1).clamp(min=torch.finfo(DTYPE).tiny)


LAMBDAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # the default candidates: λ is relative, so one grid fits every layer


@dataclass
class LambdaChoice:
    """The λ picked for each group of outputs, and the map solved with it."""

    lam: list[float]  # (groups,)
    r2: list[float]  # (groups,) held-out variance-weighted R² at the picked λ
    scores: dict[float, list[float]]  # every candidate's held-out R² per group
    w: torch.Tensor  # (I, O): each group's columns solved at its own λ
    b: torch.Tensor  # (O,)


def pick_lambda(
    fit: Moments, held_out: Moments, candidates: tuple[float, ...] | list[float] = LAMBDAS, groups: int = 1, rel_tol: float = 1e-8
) -> LambdaChoice:
    """The λ selection every ridge fit in kvforge uses: solve on `fit` at each candidate (one
    eigendecomposition), score each of `groups` equal blocks of outputs by held-out
    variance-weighted R² (`r2_pooled`), and keep per block the best candidate (the first listed
    on a tie). One candidate is a fixed λ, still scored."""
    if not candidates:
        raise ValueError("give at least one λ candidate")
    decomposition = eigen(fit)
    width = fit.xy.shape[1] // groups
    choice = None
    for lam in candidates:
        w, b = solve(fit, lam, rel_tol, decomposition)
        per_group = r2_pooled(held_out, w, b, groups).tolist()
        if choice is None:
            choice = LambdaChoice([lam] * groups, list(per_group), {}, w, b)
        else:
            for g, score in enumerate(per_group):
                if score > choice.r2[g]:
                    cols = slice(g * width, (g + 1) * width)
                    choice.lam[g], choice.r2[g] = lam, score
                    choice.w[:, cols], choice.b[cols] = w[:, cols], b[cols]
        choice.scores[lam] = per_group
    return choice


def explained(moments: Moments, lam: float = 0.0, rel_tol: float = 1e-8) -> float:
    """Variance-weighted R² (1 - ΣSSE / ΣSST) of the ridge fit on its own data."""
    w, b = solve(moments, lam, rel_tol)
    return float(r2_pooled(moments, w, b))


def greedy_select(
    moments: Moments, groups: list[torch.Tensor], count: int, outputs: torch.Tensor, lam: float = 0.0, rel_tol: float = 1e-8
) -> list[int]:
    """Forward selection: `count` of the input groups (index tensors into the inputs), each step
    adding the group whose joint ridge fit with those already chosen leaves the least residual
    on `outputs`. Returns the chosen group numbers in the order picked."""
    if count > len(groups):
        raise ValueError(f"cannot select {count} of {len(groups)} groups")
    chosen: list[int] = []
    for _ in range(count):
        best, best_r2 = -1, -float("inf")
        for g in range(len(groups)):
            if g in chosen:
                continue
            inputs = torch.cat([groups[i] for i in chosen + [g]])
            score = explained(moments.select(inputs, outputs), lam, rel_tol)
            if score > best_r2:
                best, best_r2 = g, score
        chosen.append(best)
    return chosen
