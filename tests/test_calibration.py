"""A verifier times its forwards before it serves; a router's adaptive speculation starts from those costs."""

from __future__ import annotations

from specdec.adaptive import Candidate, SpeculationController
from specdec.calibration import calibration_sizes, measure_forward_costs
from specdec.runner import KVRunner
from tests.tiny_models import tiny_llama


def test_the_sizes_are_powers_of_two_up_to_the_largest() -> None:
    assert calibration_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert calibration_sizes(40) == [1, 2, 4, 8, 16, 32]
    assert calibration_sizes(0) == []


def test_each_size_is_reported_once_and_nothing_stays_open() -> None:
    runner = KVRunner(tiny_llama(seed=3, vocab_size=16).model)
    costs = measure_forward_costs(runner, 16)
    assert [positions for positions, _ in costs] == [1, 2, 4, 8, 16]
    assert all(seconds > 0 for _, seconds in costs)
    assert runner.num_open == 0
    assert measure_forward_costs(runner, 0) == []


def test_sizes_stop_where_the_context_ends() -> None:
    runner = KVRunner(tiny_llama(seed=3, vocab_size=16, max_positions=64).model)
    assert [positions for positions, _ in measure_forward_costs(runner, 64)] == [1, 2, 4, 8, 16, 32]


def _controller(forward_costs: list[tuple[int, float]]) -> SpeculationController:
    controller = SpeculationController(4)
    for positions, seconds in forward_costs:
        for _ in range(6):
            controller.cost.forward.observe(positions, seconds)
    for _ in range(20):
        controller.cost.draft_level.observe(5, 0.004)
    controller.cost.overhead_s.add(0.005)
    controller.cost.draft_call_s.add(0.003)
    return controller


def _lengths(controller: SpeculationController) -> list[int]:
    trackers = [controller.tracker() for _ in range(5)]
    for tracker in trackers:
        for accepted in [0, 0, 1, 1, 2, 4] * 5:
            tracker.observe(4, accepted)
    return controller.choose([Candidate.for_round(tracker, 4, 4, tree=False) for tracker in trackers])


def test_calibrated_costs_keep_auto_from_pricing_a_large_forward_as_a_small_one() -> None:
    # The CPU stack's forwards (ms): 1-5 positions all ~50, then 10: 60, 15: 76, 20: 92, 25: 108. A router that has
    # only seen plain steps of five streams (1-5 positions) extrapolates that flat line and drafts all 4 tokens a
    # stream (25 positions, priced like 5); with the verifier's calibrated ladder it drafts the 2 that pay.
    plain_steps = [(1, 0.051), (2, 0.060), (3, 0.052), (4, 0.050), (5, 0.050)]
    cold = _controller(plain_steps)
    assert cold.cost.forward.seconds(25) < 0.055
    assert _lengths(cold) == [4] * 5
    calibrated = _controller(plain_steps)
    calibrated.learn_forward_costs([(1, 0.050), (2, 0.050), (4, 0.050), (8, 0.058), (16, 0.080), (32, 0.125)])
    assert 0.09 < calibrated.cost.forward.seconds(25) < 0.12
    assert _lengths(calibrated) == [2] * 5
