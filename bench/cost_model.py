"""The seed's cost model for choosing γ (DESIGN §7), fed with measured α and measured round costs.

With i.i.d. acceptance α per drafted token, a round of γ drafted tokens commits
``E[N] = 1 + α + … + α^γ = (1 − α^(γ+1)) / (1 − α)`` tokens in expectation, and the time per committed token
is ``round time / E[N]``. Round time is measured per γ and also fitted as ``fixed + per_token · γ`` (one
verify forward plus γ draft steps), so γ values that were not run can be predicted too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """``1 + α + … + α^γ``; e.g. α = 0.5, γ = 2 gives 1.75, and α = 1 gives γ + 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return sum(alpha**i for i in range(gamma + 1))


@dataclass(frozen=True)
class LinearCost:
    """Round time in ms as ``fixed_ms + per_token_ms · γ`` (least squares over the measured γ)."""

    fixed_ms: float
    per_token_ms: float

    def round_ms(self, gamma: int) -> float:
        return self.fixed_ms + self.per_token_ms * gamma


def fit_round_cost(gammas: Sequence[int], round_ms: Sequence[float]) -> LinearCost:
    """Least-squares line through (γ, round ms); ``fit_round_cost([1, 3], [12, 16])`` is 10 + 2γ."""
    if len(gammas) != len(round_ms) or len(set(gammas)) < 2:
        raise ValueError("need round times for at least two distinct γ")
    n = len(gammas)
    mean_g, mean_t = sum(gammas) / n, sum(round_ms) / n
    slope = sum((g - mean_g) * (t - mean_t) for g, t in zip(gammas, round_ms, strict=True)) / sum(
        (g - mean_g) ** 2 for g in gammas
    )
    return LinearCost(mean_t - slope * mean_g, slope)


def predicted_ms_per_token(alpha: float, gamma: int, cost: LinearCost) -> float:
    """``(fixed + per_token · γ) / E[N]``: the model's time per committed token at this γ."""
    return cost.round_ms(gamma) / expected_tokens_per_round(alpha, gamma)


def best_gamma(alpha: float, cost: LinearCost, gammas: Sequence[int]) -> int:
    """The γ among ``gammas`` with the lowest predicted time per committed token."""
    return min(gammas, key=lambda gamma: predicted_ms_per_token(alpha, gamma, cost))
