"""The γ cost model against hand-computed values."""

import pytest

from bench.cost_model import (
    LinearCost,
    best_gamma,
    expected_tokens_per_round,
    fit_round_cost,
    predicted_ms_per_token,
)


def test_expected_tokens_per_round_matches_the_closed_form() -> None:
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.0, 4) == 1.0
    alpha, gamma = 0.7, 5
    assert expected_tokens_per_round(alpha, gamma) == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha))
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_round(1.5, 2)


def test_fit_round_cost_recovers_a_line_and_is_least_squares() -> None:
    cost = fit_round_cost([1, 3], [12.0, 16.0])
    assert (cost.fixed_ms, cost.per_token_ms) == pytest.approx((10.0, 2.0))
    # points (0, 0), (1, 1), (2, 1): slope 0.5, intercept 1/6
    cost = fit_round_cost([0, 1, 2], [0.0, 1.0, 1.0])
    assert (cost.fixed_ms, cost.per_token_ms) == pytest.approx((1 / 6, 0.5))
    with pytest.raises(ValueError):
        fit_round_cost([2, 2], [1.0, 2.0])


def test_prediction_and_best_gamma() -> None:
    cost = LinearCost(fixed_ms=30.0, per_token_ms=5.0)
    # α = 0.5: γ=1 → 35/1.5 = 23.33, γ=2 → 40/1.75 = 22.86, γ=3 → 45/1.875 = 24.0
    assert predicted_ms_per_token(0.5, 1, cost) == pytest.approx(35 / 1.5)
    assert predicted_ms_per_token(0.5, 2, cost) == pytest.approx(40 / 1.75)
    assert best_gamma(0.5, cost, [1, 2, 3, 4]) == 2
    assert best_gamma(0.95, cost, [1, 2, 4, 8]) == 8


def _summary(gamma: int, rounds: int, drafted: int, accepted: int, round_ms: float) -> dict:
    tokens = rounds + accepted  # each round commits its accepted tokens plus one from the target
    return {
        "num_rounds": rounds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted,
        "tokens_per_round": tokens / rounds,
        "wall_ms_per_round": round_ms,
        "output_throughput": 1e3 * tokens / (rounds * round_ms),
    }


def test_gamma_analysis_puts_measured_numbers_beside_the_model() -> None:
    from bench.compare import gamma_analysis

    summaries = {
        "γ=1": _summary(1, rounds=10, drafted=10, accepted=5, round_ms=12.0),  # α = 0.5
        "γ=3": _summary(3, rounds=10, drafted=30, accepted=15, round_ms=16.0),  # α = 0.5
    }
    analysis = gamma_analysis(summaries, (1, 3))
    assert analysis["cost"] == pytest.approx({"fixed_ms": 10.0, "per_token_ms": 2.0})
    assert analysis["pooled_alpha"] == pytest.approx(0.5)
    first, second = analysis["rows"]
    assert first["model_tokens_per_round"] == pytest.approx(1.5)
    assert second["model_tokens_per_round"] == pytest.approx(1.875)
    assert first["ms_per_token"] == pytest.approx(12.0 / 1.5)  # measured: 15 tokens over 10 rounds
    assert second["ms_per_token"] == pytest.approx(16.0 / 2.5)
    assert second["model_ms_per_token"] == pytest.approx(16.0 / 1.875)
    # model: 12 / 1.5 = 8.0 ms at γ=1 beats 16 / 1.875 = 8.53 at γ=3; measured 6.4 at γ=3 beats 8.0
    assert analysis["best_gamma"] == {"measured": 3, "model": 1, "model_pooled_alpha": 1}
