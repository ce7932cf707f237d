"""When a worker's pass waits for the sequences it expects back (:class:`grpc_common.arrivals.ArrivalWait`):
worked examples on a hand-made timeline (seconds), no threads, no clocks."""

from __future__ import annotations

import pytest

from grpc_common.arrivals import ArrivalWait

FORWARD = 0.020


def forward(policy: ArrivalWait, sequence_ids: list[str], started: float, ended: float) -> None:
    """A forward from ``started`` to ``ended`` answered ``sequence_ids`` (what the scheduler tells the policy)."""
    policy.served(sequence_ids, ended)
    policy.timed(len(sequence_ids), ended - started)


def learnt(fraction: float = 0.25) -> ArrivalWait:
    """a and b were served by one 20 ms forward ending at t = 0.020; a came back 0.1 ms later, b 3 ms later; both
    were then served again by a forward ending at t = 0.045."""
    policy = ArrivalWait(fraction)
    forward(policy, ["a", "b"], 0.000, FORWARD)
    policy.arrived("a", FORWARD + 0.0001)
    policy.arrived("b", FORWARD + 0.003)
    forward(policy, ["a", "b"], 0.025, 0.025 + FORWARD)
    return policy


def test_a_pass_waits_for_a_sequence_expected_within_a_fraction_of_a_forward() -> None:
    policy = learnt()
    now = 0.0451  # a is back; b is expected at 0.048, within 0.25 × 20 ms = 5 ms of now
    assert policy.until({"a"}, {"a", "b"}, now) == pytest.approx(now + 0.25 * FORWARD)


def test_the_wait_stops_where_it_no_longer_pays() -> None:
    policy = learnt(fraction=1.0)
    now = 0.0451
    # one waiting, one expected: waiting w costs the one w and spares the other about a forward: at most F / 2
    assert policy.until({"a"}, {"a", "b"}, now) == pytest.approx(now + FORWARD / 2)
    # three already waiting for the one expected: at most F / 4
    assert policy.until({"a", "x", "y"}, {"a", "b", "x", "y"}, now) == pytest.approx(now + FORWARD / 4)


def test_no_wait_without_an_expected_sequence() -> None:
    policy = learnt()
    now = 0.0451
    assert policy.until({"a", "b"}, {"a", "b"}, now) == now  # every sequence has arrived
    assert policy.until({"a"}, {"a"}, now) == now  # b has been closed
    assert policy.until({"a"}, {"a", "b"}, 0.035) == 0.035  # b is due at 0.048, past 0.035 + 5 ms
    assert policy.until({"a"}, {"a", "b"}, 0.040 + FORWARD + 0.030) == 0.040 + FORWARD + 0.030  # b overdue by > F
    assert ArrivalWait(0.0).until({"a"}, {"a", "b"}, now) == now  # the policy is off
    fresh = ArrivalWait()
    forward(fresh, ["a", "b"], 0.0, FORWARD)
    assert fresh.until({"a"}, {"a", "b"}, 0.0201) == 0.0201  # b's habits are not known yet


def test_a_sequence_due_later_than_the_horizon_is_not_waited_for() -> None:
    policy = ArrivalWait(0.25)
    forward(policy, ["a", "b"], 0.0, FORWARD)
    policy.arrived("a", FORWARD)
    policy.arrived("b", FORWARD + 0.015)  # b drafts for 15 ms between rounds
    forward(policy, ["a", "b"], 0.040, 0.040 + FORWARD)
    assert policy.until({"a"}, {"a", "b"}, 0.060) == 0.060


def test_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="fraction"):
        ArrivalWait(1.5)


def test_where_a_forward_costs_more_per_call_joining_saves_less_and_the_wait_shrinks_or_goes() -> None:
    policy = ArrivalWait(1.0)
    end = 0.0
    for index in range(40):  # a CPU's forwards: 5 ms fixed + 1 ms per call, of 1 and 4 calls in turn
        ids = ["b"] if index % 2 else ["b", "x", "y", "z"]
        start = index * 0.1
        end = start + 0.005 + 0.001 * len(ids)
        forward(policy, ids, start, end)
        policy.arrived("b", end + 0.001)  # b is back 1 ms after each forward
    fixed, per_call = policy.cost_line()
    assert fixed == pytest.approx(0.005) and per_call == pytest.approx(0.001)
    forward(policy, ["b"], 4.0, 4.006)
    now = 4.0061  # b is due at 4.007
    # one present: joining spares b the 5 ms fixed cost less 1 ms of a's: wait up to (5 - 1) / 2 = 2 ms
    assert policy.until({"a"}, {"a", "b"}, now) == pytest.approx(now + 0.002)
    # five present: b's joining costs them as much as it spares b: no wait
    assert policy.until({"a", "p", "q", "r", "s"}, {"a", "b", "p", "q", "r", "s"}, now) == now


def test_closed_sequences_are_forgotten_and_nothing_is_kept_when_the_wait_is_off() -> None:
    policy = learnt()
    forward(policy, ["c"], 0.050, 0.070)
    assert policy.tracked == 3
    policy.until({"a"}, {"a"}, 0.0701)  # b and c have been closed
    assert policy.tracked == 1
    off = ArrivalWait(0.0)
    for index in range(100):
        forward(off, [f"s{index}"], index, index + 0.02)
        off.arrived(f"s{index}", index + 0.03)
    assert off.tracked == 0
