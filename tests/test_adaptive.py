"""The adaptive speculation controller against worked examples and a simulated verifier cost curve."""

from __future__ import annotations

import itertools
import random

import pytest

from specdec.adaptive import (
    FULL_SAMPLES,
    AcceptanceTracker,
    Candidate,
    CostCurve,
    RankTracker,
    SpeculationController,
    drafted_work,
    rows_per_level,
)


def controller_with(forward_ms, *, draft_level_ms: float = 0.0, overhead_ms: float = 0.0, max_length: int = 8):
    """A controller whose costs were measured (each count ``FULL_SAMPLES`` times) on a verifier with
    ``forward_ms(positions)``."""
    controller = SpeculationController(max_length)
    for positions, _ in itertools.product(range(1, 65), range(FULL_SAMPLES)):
        controller.cost.forward.observe(positions, forward_ms(positions) / 1e3)
    controller.cost.draft_level.observe(1, draft_level_ms / 1e3)
    controller.cost.overhead_s.add(overhead_ms / 1e3)
    return controller


def fixed_tracker(rate: float, length: int = 8) -> AcceptanceTracker:
    return AcceptanceTracker([rate] * length)


def test_tracker_rates_shrink_observations_to_the_prior() -> None:
    tracker = AcceptanceTracker([0.5, 0.5, 0.5], prior_weight=4.0, decay=1.0)
    tracker.observe(proposed=3, accepted=1)  # position 1 accepted, 2 tried and rejected, 3 never tried
    # position 1 shrinks to the prior 0.5, each later one to the estimate before it
    assert tracker.rates() == pytest.approx([(1 + 4 * 0.5) / 5, (0 + 4 * 0.6) / 5, 0.48])
    assert tracker.expected_tokens(2) == pytest.approx(1 + 0.6 + 0.6 * 0.48)


def test_tracker_forgets_when_nothing_is_proposed() -> None:
    tracker = AcceptanceTracker([0.5], prior_weight=1.0, decay=0.5)
    for _ in range(4):
        tracker.observe(proposed=1, accepted=0)
    low = tracker.rates()[0]
    for _ in range(10):
        tracker.fade()
    assert low < 0.2 and tracker.rates()[0] == pytest.approx(0.5, abs=0.01)


def test_cost_curve_interpolates_and_extends() -> None:
    curve = CostCurve()
    curve.observe(1, 0.010)
    assert curve.seconds(9) == pytest.approx(0.010 * (1 + 0.125 * 8))  # one point: the prior line through it
    curve.observe(5, 0.015)
    assert curve.seconds(3) == pytest.approx(0.0125)
    assert curve.seconds(9) == pytest.approx(0.015 + 0.00125 * 4)
    assert curve.points() == [(1, 0.010), (5, 0.015)]


def test_cost_curve_below_every_measured_count_keeps_the_cost_per_position() -> None:
    flat = CostCurve()
    flat.observe(8, 0.010)
    flat.observe(16, 0.012)
    assert flat.seconds(4) == pytest.approx(0.010 - 4 * 0.00025)  # the line, above 4 positions at 10 ms / 8
    steep = CostCurve()
    steep.observe(8, 0.010)
    steep.observe(16, 0.030)  # 2.5 ms a position: the line through them crosses 0 at 4 positions
    assert steep.seconds(6) == pytest.approx(6 * 0.010 / 8)  # not the line's 5 ms
    assert steep.seconds(1) == pytest.approx(0.010 / 8)  # not 0 s: an unpriced plain round divides by zero


def test_cost_curve_ignores_pauses_that_slowed_single_forwards_but_follows_a_real_change() -> None:
    curve = CostCurve()
    curve.observe(4, 0.010)
    curve.observe(4, 0.085)  # the second forward of that size was preempted
    assert curve.seconds(4) == pytest.approx(0.010)
    for seconds in (0.010, 0.040, 0.010):  # two of the five slowed
        curve.observe(4, seconds)
    assert curve.seconds(4) == pytest.approx(0.010)
    for _ in range(10):  # the forward really got dearer
        curve.observe(4, 0.020)
    assert curve.seconds(4) == pytest.approx(0.020)


def test_one_slow_forward_does_not_keep_the_controller_from_the_draft_length_that_pays() -> None:
    """The CPU stack's case: after one forward of the chosen size ran 3x long (a pause), the controller kept choosing
    a shorter draft, never measured the longer one again, and ran slower than fixed-length speculation."""
    controller = controller_with(lambda n: 22 + 0.7 * (n - 1), draft_level_ms=1.1, overhead_ms=1.7)
    tracker = fixed_tracker(0.6)
    [best] = controller.choose([Candidate(tracker, 8)])
    assert best >= 2
    controller.cost.forward.observe(1 + best, 3 * (22 + 0.7 * best) / 1e3)
    assert controller.choose([Candidate(tracker, 8)]) == [best]


def test_a_count_measured_once_is_priced_mostly_by_the_line_through_every_count() -> None:
    """The CPU stack's case (a debug log of the controller's inputs): 2 positions measured 10 times at 24 ms, and
    once each 1 at 29 ms, 3 at 31, 5 at 34 (slow first forwards), 31 at 58 and 105 at 141. Priced at those single
    samples, one drafted token looked better than 2-4 at an acceptance of 0.55, and the request drafted 1 token a
    round for 14 rounds (``auto`` 0.86x of sequential speculation on that prompt). A count
    measured fewer than ``FULL_SAMPLES`` times fills its missing samples from the line fitted through every count
    (weighted by measurements), so one noisy sample counts a quarter; a count measured that often keeps its own
    mean."""
    controller = SpeculationController(8)
    for _ in range(10):
        controller.cost.forward.observe(2, 0.0238)
    for positions, seconds in ((1, 0.029), (3, 0.0309), (5, 0.0337), (31, 0.0576), (105, 0.1414)):
        controller.cost.forward.observe(positions, seconds)
    for _ in range(10):
        controller.cost.draft_level.observe(1, 0.00085)
    controller.cost.overhead_s.add(0.002)
    controller.cost.draft_call_s.add(0.0026)
    curve = controller.cost.forward
    assert 0.0238 < curve.seconds(5) < 0.030
    assert curve.seconds(2) == pytest.approx(0.0238)
    assert controller.choose([Candidate(fixed_tracker(0.55), 4)]) >= [3]
    for _ in range(FULL_SAMPLES - 1):
        curve.observe(5, 0.0337)
    assert curve.seconds(5) == pytest.approx(0.0337)  # measured that often: its own


def test_memory_bound_verifier_worked_example() -> None:
    # forward 10 ms + 1 ms per extra position, 0.5 ms per draft level, every position accepted at 0.8:
    # E(γ)/T(γ) in tokens/s is 100, 156.5, 187.7, 203.6, 210.1, 210.8, 208.0, 203.0, 196.8 for γ = 0..8.
    controller = controller_with(lambda n: 10 + (n - 1), draft_level_ms=0.5)
    assert controller.choose([Candidate(fixed_tracker(0.8), 8)]) == [5]
    assert controller.choose([Candidate(fixed_tracker(0.8), 3)]) == [3]  # capped by the request


def test_no_speculation_when_every_position_costs_a_forward() -> None:
    # A compute-bound verifier: each position costs as much as a whole step, so a draft token below
    # certain acceptance always costs more than it commits.
    controller = controller_with(lambda n: 10.0 * n)
    assert controller.choose([Candidate(fixed_tracker(0.9), 8)]) == [0]
    # Beside 40 plain target steps (one token per position) the same holds; beside a batch committing fewer
    # tokens per position than a draft token's 0.9, drafting raises the batch's tokens per second.
    assert controller.choose([Candidate(fixed_tracker(0.9), 8)], other_positions=40, other_tokens=40) == [0]
    assert controller.choose([Candidate(fixed_tracker(0.9), 8)], other_positions=40, other_tokens=15) != [0]


def test_speculation_must_beat_plain_steps_by_the_margin() -> None:
    # γ = 1 accepted at 0.5 commits 1.5 tokens; a forward of 2 positions costs 14.4 ms against 10 ms for one:
    # 104.2 tokens/s against 100, a predicted 4 % gain, inside the default 5 % margin, so no drafting...
    controller = controller_with(lambda n: 10 + 4.4 * (n - 1), max_length=1)
    assert controller.choose([Candidate(fixed_tracker(0.5, 1), 1)]) == [0]
    # ...which a controller without the margin would take, and at 13 ms (115 tokens/s) the default takes too
    controller.min_gain = 0.0
    assert controller.choose([Candidate(fixed_tracker(0.5, 1), 1)]) == [1]
    assert controller_with(lambda n: 10 + 3.0 * (n - 1), max_length=1).choose(
        [Candidate(fixed_tracker(0.5, 1), 1)]
    ) == [1]


def test_batch_choice_is_the_brute_force_optimum_without_draft_cost() -> None:
    controller = controller_with(lambda n: 8 + 0.5 * n + 0.02 * n * n)
    trackers = [fixed_tracker(0.9, 6), fixed_tracker(0.5, 6), fixed_tracker(0.2, 6)]
    chosen = controller.choose([Candidate(tracker, 6) for tracker in trackers])

    def goodput(lengths) -> float:
        tokens = sum(t.expected_tokens(g) for t, g in zip(trackers, lengths, strict=True))
        return tokens / controller.cost.seconds(sum(lengths) + len(lengths), 0)

    best = max(itertools.product(range(7), repeat=3), key=goodput)
    assert goodput(chosen) == pytest.approx(goodput(best))
    assert chosen[0] > chosen[1] >= chosen[2]  # the better a request's acceptance, the longer its draft


def test_load_from_other_requests_shortens_the_draft() -> None:
    controller = controller_with(lambda n: 10 + 0.2 * n + 0.01 * n * n)
    alone = controller.choose([Candidate(fixed_tracker(0.7), 8)])[0]
    crowded = controller.choose([Candidate(fixed_tracker(0.7), 8)], other_positions=120, other_tokens=150)[0]
    assert alone > crowded


def test_a_tree_is_sent_whole_or_not_at_all() -> None:
    cheap = controller_with(lambda n: 10 + 0.1 * (n - 1))
    assert cheap.choose([Candidate(fixed_tracker(0.6), 3, tree_nodes=6)]) == [3]
    dear = controller_with(lambda n: 10.0 * n)
    assert dear.choose([Candidate(fixed_tracker(0.6), 3, tree_nodes=6)]) == [0]


def test_a_rank_tracker_shrinks_each_ranks_acceptance_to_its_prior_and_never_rises_with_rank() -> None:
    ranks = RankTracker([0.6, 0.3, 0.3, 0.1], prior_weight=2.0, decay=1.0)
    ranks.observe(nodes=3, accepted=[0, 2])  # a 3-node tree whose verdict accepted nodes 0 and 2 (a path)
    # rank 1: (1 + 2 · 0.6) / 3; rank 2: (0 + 2 · 0.3) / 3 = 0.2; rank 3: (1 + 0.6) / 3 = 0.53, held to 0.2 by rank 2;
    # rank 4 was never tried: its prior, 0.1; a fifth, past the prior, goes on from 0.2 to 0.1: 0.05
    assert ranks.gains(5) == pytest.approx([2.2 / 3, 0.2, 0.2, 0.1, 0.05])


def test_a_rank_past_the_prior_goes_on_with_the_decline_measured_before_it() -> None:
    ranks = RankTracker([0.6], prior_weight=2.0, decay=1.0)
    assert ranks.gains(3) == pytest.approx([0.6, 0.36, 0.216])  # one rate: a geometric prior
    ranks.observe(nodes=2, accepted=[0])
    first = 2.2 / 3  # (1 + 2 · 0.6) / 3
    second = 2 * first**2 / 3  # tried once, rejected, shrunk to first²
    assert ranks.gains(3) == pytest.approx([first, second, second**2 / first])
    for _ in range(200):  # a head that pays deep: 4-node trees whose ranks are accepted 0.9, 0.8, 0.7, 0.6 of rounds
        for accepted in ((0, 1, 2, 3),) * 6 + ((0, 1, 2),) + ((0, 1),) + ((0,),) + ((),):
            ranks.observe(nodes=4, accepted=accepted)
    measured = ranks.gains(6)
    assert measured[:4] == pytest.approx([0.9, 0.8, 0.7, 0.6], abs=0.05)
    assert measured[4] == pytest.approx(0.6 * 0.6 / 0.7, abs=0.05)  # not a small fixed prior: tried where that pays


def test_a_dynamic_tree_is_cut_to_the_nodes_that_pay() -> None:
    """A dynamic tree 3 deep with room for 4 nodes, its ranks accepted at 0.8, 0.5, 0.1, 0.05; forward 10 ms + 1 ms per
    extra position, drafting free: b nodes commit 1 + Σ p_r in 10 + b ms, 1.8 / 11, 2.3 / 12 (best), 2.4 / 13,
    2.45 / 14 tokens/ms. Sent whole or not at all (no rank estimate) the tree's 4 nodes were all or nothing."""
    controller = controller_with(lambda n: 10 + (n - 1))
    tracker = fixed_tracker(0.6)
    tracker.ranks = RankTracker([0.8, 0.5, 0.1, 0.05])
    candidate = Candidate.for_round(tracker, 3, 4, tree=True)
    assert controller.choose([candidate]) == [2] and candidate.node_budget(2) == 2
    assert candidate.node_budget(9) == 4  # never more than the round has room for
    # a level of one row measured at 3 ms, of this tree's 2 rows priced 3.375: 1.8 / 14.4 beats 2.3 / 18.75
    dear_drafts = controller_with(lambda n: 10 + (n - 1), draft_level_ms=3.0)
    assert dear_drafts.choose([candidate]) == [1]
    cheap = controller_with(lambda n: 10 + 0.01 * (n - 1))
    assert cheap.choose([candidate]) == [4]
    whole = Candidate.for_round(fixed_tracker(0.6), 3, 4, tree=True)
    assert whole.ranks is None and whole.node_budget(3) == 4


def test_a_cut_dynamic_tree_is_measured_as_the_levels_and_rows_it_is_priced_at() -> None:
    # d4 w2 b8 cut to 2 nodes: 2 levels of the whole tree's 2 rows, whether the two are a chain or siblings
    assert drafted_work(2, 2, (4, 8)) == drafted_work(2, 1, (4, 8)) == (2, 2)
    assert drafted_work(6, 3, (4, 8)) == (4, 2)  # 6 nodes need all 4 levels
    assert drafted_work(1, 1, (3, 9)) == (1, 3)
    assert drafted_work(0, 0, (4, 8)) == (0, 0)  # nothing drafted
    assert drafted_work(2, 1) == (1, 2)  # any other tree: its own depth and rows
    assert drafted_work(3, 3) == (3, 1)  # a chain


def test_a_dynamic_trees_verdict_moves_its_rank_estimate_and_the_populations() -> None:
    controller = SpeculationController(4, probe_every=1000)
    tracker = controller.tracker()
    tracker.ranks = controller.rank_tracker()
    before = tracker.ranks.gains(4)
    assert before == pytest.approx([0.5, 0.25, 0.125, 0.0625])  # no tree measured yet: a geometric prior
    for _ in range(3):  # a 4-node tree whose verdicts accept nodes 0 and 1, never 2 or 3
        controller.observe_verdict(tracker, 2, 2, nodes=4, accepted_nodes=(0, 1))
    after = tracker.ranks.gains(4)
    assert after[0] > before[0] and after[1] > before[1]
    assert after[2] < after[1] - 0.2 and after[3] < after[2]  # rejected, below what ranks 1-2's flat decline suggest
    newcomer = controller.rank_tracker().gains(4)  # a new request starts from what the population accepts
    assert newcomer[0] > before[0] and newcomer[1] > before[1] and newcomer[2] < newcomer[1] - 0.1
    tracker.lookup = controller.lookup_tracker()
    controller.observe_verdict(tracker, 1, 1, model_free=True, nodes=1, accepted_nodes=(0,))
    assert tracker.ranks.gains(4) == after  # a prompt-lookup chain says nothing of the tree's ranks


def test_pipelining_pays_only_where_the_drafting_it_hides_outweighs_the_deferred_bonus() -> None:
    """Forward 10 ms + 1 ms per extra position, every position accepted at 0.8, a chain 4 deep: E = 3.3616 tokens,
    whole acceptance G = 0.4096. Sequential: E / (4 d + 14) ms; pipelined: (E - G) / ((1 - G)(4 d + 14) + 13 G)."""
    tracker = fixed_tracker(0.8)
    cheap = controller_with(lambda n: 10 + (n - 1), draft_level_ms=0.5)  # 0.2101 vs 0.1999 tokens/ms
    assert not cheap.pipelining_pays(tracker, 4, 4)
    dear = controller_with(lambda n: 10 + (n - 1), draft_level_ms=5.0)  # 0.0989 vs 0.1163 tokens/ms
    assert dear.pipelining_pays(tracker, 4, 4)
    # One level deep a pipelined round commits exactly one token, as a plain step does: at 5 ms per level
    # sequential 1.8 / 16 beats pipelined 1 / 11.2 tokens/ms (and plain steps, 1 / 10, beat both).
    assert not dear.pipelining_pays(tracker, 1, 1)
    free = controller_with(lambda n: 10 + (n - 1))  # drafting that costs nothing gains nothing from being hidden
    assert not any(free.pipelining_pays(fixed_tracker(rate), depth, depth) for rate in (0.3, 0.9) for depth in (1, 4))
    assert not dear.pipelining_pays(tracker, 0, 0)


@pytest.mark.parametrize(("rate", "best"), [(0.85, 7), (0.05, 0)])
def test_learns_acceptance_and_cost_from_simulated_rounds(rate: float, best: int) -> None:
    """Rounds on a simulated verifier (10 ms + 1 ms per position, ±10 % noise) with a drafter whose every position
    is accepted with ``rate``, where E(γ)/T(γ) peaks at ``best``: after a warm-up the controller drafts within one
    of it, but for the few rounds it spends trying again as old evidence fades."""
    rng = random.Random(5)
    controller = SpeculationController(8)
    tracker = controller.tracker()
    chosen = []
    for _ in range(300):
        [length] = controller.choose([Candidate(tracker, 8)])
        accepted = next((i for i in range(length) if rng.random() > rate), length)
        controller.observe_verdict(tracker, length, accepted)
        positions = 1 + length
        controller.observe_round(positions, (10 + positions - 1) / 1e3 * rng.uniform(0.9, 1.1), length, 0.0, 0.0)
        chosen.append(length)
    settled = chosen[-100:]
    assert sum(abs(length - best) <= 1 for length in settled) >= 90


def test_a_bad_start_does_not_stop_speculation_for_good() -> None:
    """The router's case on this CPU: forward 57 ms + 5 ms per extra position, 7 ms per draft level, 4 ms per round
    besides. A first request that accepts nothing in 80 rounds drags the population prior down, so the next request's
    estimate starts so low that no draft is predicted to pay; probing (one level at once, as a new request, then after
    ``probe_every`` idle rounds) finds that this request accepts at 0.85, and the controller settles near the best γ
    (5: E(γ)/T(γ) is 16.4, 34.0, 34.3, 34.1 tokens/s at γ = 0, 4, 5, 6), as it would from a fair start."""
    rng = random.Random(7)
    controller = controller_with(lambda n: 57 + 5 * (n - 1), draft_level_ms=7.0, overhead_ms=4.0)
    first = controller.tracker()
    for _ in range(80):
        [length] = controller.choose([Candidate(first, 8)])
        controller.observe_verdict(first, length, 0)
    tracker = controller.tracker()
    assert controller.choose([Candidate(fixed_tracker(tracker.rates()[0]), 8)]) == [0]  # no draft is predicted to pay
    assert controller.choose([Candidate(tracker, 8)]) == [1]  # but a new request probes at once
    chosen = []
    for _ in range(300):
        [length] = controller.choose([Candidate(tracker, 8)])
        accepted = next((i for i in range(length) if rng.random() > 0.85), length)
        controller.observe_verdict(tracker, length, accepted)
        chosen.append(length)
    assert sum(abs(length - 5) <= 1 for length in chosen[-100:]) >= 80


def test_a_greeting_whose_drafts_were_rejected_does_not_keep_the_next_request_from_drafting() -> None:
    """``make demo``'s case on this CPU (costs as the router measured them: forward 20 ms + 2.5 ms per extra
    position, 1.3 ms per draft level, 2.3 ms per round besides and 2.8 ms per drafter call): its warm-up, a greeting
    of 4 tokens, had both its drafts rejected. With a population prior of 2 observations that left the population at
    0.25 by position, where no draft is predicted to pay, and the next request, whose drafts the head gets right,
    drafted nothing until its first probe 16 rounds in. Now the population's prior weighs 8 observations, so it stays
    at 0.4, where a draft pays; and a new request would probe at once anyway. It drafts deep within a few rounds."""
    controller = controller_with(lambda n: 20 + 2.5 * (n - 1), draft_level_ms=1.3, overhead_ms=2.3, max_length=4)
    controller.cost.draft_call_s.add(2.8e-3)
    greeting = controller.tracker()
    for _ in range(2):
        controller.observe_verdict(greeting, 2, 0)
    tracker = controller.tracker()
    assert tracker.rates()[0] == pytest.approx(0.4, abs=0.01)
    assert controller.choose([Candidate(fixed_tracker(0.25, 4), 4)]) == [0]  # where no draft is predicted to pay
    assert controller.choose([Candidate(fixed_tracker(0.4, 4), 4)]) == [1]
    lengths = []
    for _ in range(6):
        [length] = controller.choose([Candidate(tracker, 4)])
        controller.observe_verdict(tracker, length, length)  # this request's drafts are accepted whole
        lengths.append(length)
    assert lengths[0] == 1 and lengths[-1] == 4, lengths


def test_one_rejected_first_draft_does_not_stop_a_request_drafting_where_the_population_says_it_pays() -> None:
    """The CPU stack's case (a debug log of the controller's inputs): forward 22.5 ms + ~0.6 ms per position, a
    draft level 1.4 ms, 2.7 ms per drafter call, 2.1 ms per round besides; the population at 0.4. A new request's
    first draft (2 tokens) was rejected; weighing its prior as 2 observations took its estimate to 0.27, where no
    draft is predicted to pay, and it drafted nothing for the next 7-38 rounds. As 4 observations: 0.32, and it
    drafts on."""
    controller = SpeculationController(4)
    for positions, ms in ((1, 22.5), (2, 23.6), (3, 24.3), (4, 25.4), (5, 25.8), (31, 51.3), (105, 132.5)):
        for _ in range(FULL_SAMPLES):
            controller.cost.forward.observe(positions, ms / 1e3)
    controller.cost.draft_level.observe(1, 1.4e-3)
    controller.cost.overhead_s.add(2.1e-3)
    controller.cost.draft_call_s.add(2.7e-3)
    controller.population = AcceptanceTracker([0.4] * 4, prior_weight=8.0)  # where the population stands
    tracker = controller.tracker()
    tracker.idle_rounds = 0  # not due a probe: this is its second round
    controller.observe_verdict(tracker, 2, 0)
    assert tracker.rates()[0] == pytest.approx(0.32)
    assert controller.choose([Candidate(tracker, 4)]) >= [1]
    weak = AcceptanceTracker([0.4] * 4, prior_weight=2.0)  # the old weight
    weak.observe(2, 0)
    assert controller.choose([Candidate(weak, 4)]) == [0]


def test_an_idle_request_probes_one_level_and_waits_twice_as_long_after_each_probe_that_fails() -> None:
    controller = controller_with(lambda n: 10.0 * n, max_length=4)  # every position costs a forward: never pays
    tracker = fixed_tracker(0.9, 4)
    lengths = []
    for _ in range(400):
        [length] = controller.choose([Candidate(tracker, 4)])
        controller.observe_verdict(tracker, length, 0)
        lengths.append(length)
    probes = [index for index, length in enumerate(lengths) if length]
    assert all(lengths[index] == 1 for index in probes)
    assert probes == [16, 16 + 1 + 32, 16 + 1 + 32 + 1 + 64, 16 + 1 + 32 + 1 + 64 + 1 + 128, 16 + 4 + 32 + 64 + 128 * 2]


def test_a_probe_that_accepts_resets_the_wait() -> None:
    controller = controller_with(lambda n: 10.0 * n, max_length=4)
    tracker = fixed_tracker(0.9, 4)
    lengths = []
    for round_index in range(100):
        [length] = controller.choose([Candidate(tracker, 4)])
        controller.observe_verdict(tracker, length, 1 if round_index == 49 else 0)  # the second probe accepts
        lengths.append(length)
    assert [index for index, length in enumerate(lengths) if length] == [16, 49, 66, 66 + 1 + 32]


def test_a_drafting_round_adds_what_its_drafter_call_measured_to_the_fixed_cost_of_every_round() -> None:
    # Every round has 1 ms of fixed cost; a round that drafts also waits 7 ms for its drafter call besides the 1 ms
    # of drafting it reports. Drafting is rare, so an average over all rounds of their whole remainder would stay
    # near 1 ms and make γ = 1 look worth it: 1.5 tokens in 1 + 1 + 10 ms against 1 token in 11 ms. At its true 8 ms
    # no γ pays (γ = 1: 1.5 / 19 < 1 / 11).
    controller = SpeculationController(8, probe_every=1000)
    for round_index in range(200):
        drafted = round_index % 10 == 9
        levels = 1 if drafted else 0
        controller.observe_round(1 + levels, 10e-3, levels, 1e-3 * levels, 1e-3, call_s=7e-3 if drafted else None)
    tracker = fixed_tracker(0.5)
    assert controller.cost.seconds(2, 1) == pytest.approx(19e-3, rel=0.02)
    assert controller.choose([Candidate(tracker, 8)]) == [0]
    for _ in range(30):  # the drafter's calls got cheap
        controller.observe_round(2, 10e-3, 1, 1e-3, 1e-3, call_s=0.0)
    assert controller.choose([Candidate(tracker, 8)])[0] >= 1


def test_drafting_is_priced_with_the_fixed_cost_the_load_has_now_not_the_one_of_the_last_drafting_round() -> None:
    """Seen on the real stack (30-minute head, 0.4 QPS): a few rounds drafted early, at low load, with 38 ms of fixed
    cost; then the load grew, plain rounds queued for the verifier (300 ms of fixed cost), and a controller that
    priced drafting rounds by their own average (still 38 ms) found drafting 5x cheaper than a plain round and
    drafted at an acceptance of 0.12: 5.12 tokens in 38 + 22 + 155 ms looked better than 5 in 300 + 145. Priced
    with the fixed cost every round pays now, γ = 1 is 5.12 tokens in 300 + 22 + 155 ms: worse than plain steps."""
    forward_ms = {1: 81, 2: 90, 5: 145, 6: 155}
    controller = SpeculationController(4, probe_every=1000)
    for _ in range(20):  # low load: one sequence, drafting one level
        controller.observe_round(2, forward_ms[2] / 1e3, 1, 21.9e-3, 38e-3)
    for _ in range(100):  # five sequences, plain, queueing
        controller.observe_round(5, forward_ms[5] / 1e3, 0, 0.0, 300e-3)
    controller.observe_round(1, forward_ms[1] / 1e3, 0, 0.0, 300e-3)
    controller.observe_round(6, forward_ms[6] / 1e3, 0, 0.0, 300e-3)
    assert controller.choose([Candidate(fixed_tracker(0.12, 4), 4)], other_positions=4, other_tokens=4.0) == [0]


def test_a_plain_round_is_priced_with_the_drafting_fixed_cost_until_one_is_measured() -> None:
    # Only drafting rounds so far, forwards measured at 5 and 9 positions on a steep line: the curve extrapolated
    # to 1 position is 0 s, and with an unmeasured plain fixed cost of 0 the plain round cost nothing (a
    # ZeroDivisionError in choose, seen through the router under `auto`).
    controller = SpeculationController(8, probe_every=1000)
    for positions, forward_s in ((5, 10e-3), (9, 30e-3)):
        controller.observe_round(positions, forward_s, positions - 1, 1e-3 * (positions - 1), 2e-3)
    assert controller.cost.fixed_s(0) == pytest.approx(2e-3)
    assert controller.cost.seconds(1, 0) > 0
    controller.choose([Candidate(fixed_tracker(0.5), 8)])


def test_a_draft_level_over_more_sequences_costs_what_was_measured_for_that_many() -> None:
    """Forward 10 ms + 0.5 ms per extra position, every position accepted at 0.6; a draft level takes 2 ms for one
    sequence but 8 ms for four (a CPU drafts them one after another). Alone, a request drafts: 1.6 tokens in 12.5 ms
    beat 1 in 10. Four together do not: γ = 1 for all is 6.4 tokens in 10 + 3.5 + 8 = 21.5 ms (0.298 / ms) against
    4 in 11.5 ms (0.348), and one of them alone 4.6 in 14 ms (0.329). Priced at one sequence's 2 ms a level, all
    four drafting would look like 6.4 in 15.5 ms (0.413)."""

    def forward_s(positions: int) -> float:
        return (10 + 0.5 * (positions - 1)) / 1e3

    controller = controller_with(lambda n: forward_s(n) * 1e3, max_length=4)
    controller.observe_round(2, forward_s(2), 1, 2e-3, 0.0, rows=1)
    controller.observe_round(8, forward_s(8), 1, 8e-3, 0.0, rows=4)
    assert controller.choose([Candidate(fixed_tracker(0.6, 4), 4)])[0] >= 1
    assert controller.choose([Candidate(fixed_tracker(0.6, 4), 4) for _ in range(4)]) == [0, 0, 0, 0]
    assert controller.cost.seconds(8, 1, rows=4) == pytest.approx(21.5e-3)


def test_a_tree_level_is_priced_by_the_rows_it_drafts_not_as_one_chain_node() -> None:
    """Forward 10 ms + 0.5 ms per extra position; a draft level of one row takes 2 ms, of four rows 8 ms. A tree of
    8 nodes over 2 levels drafts 4 rows a level: 1 + 0.6 + 0.36 = 1.96 tokens in 10 + 4 + 2 · 8 = 30 ms (0.065 / ms)
    against plain steps' 0.1 / ms, so no tree. Priced as one row a level (2 ms) it would look like 1.96 in 18 ms
    (0.109 / ms, past the 5 % margin) and be drafted. A chain of 2 drafts one row a level: 1.96 in 11 + 2 · 2 ms."""

    def forward_s(positions: int) -> float:
        return (10 + 0.5 * (positions - 1)) / 1e3

    controller = controller_with(lambda n: forward_s(n) * 1e3, max_length=2)
    controller.observe_round(3, forward_s(3), 2, 4e-3, 0.0, 1)  # a chain of 2: one row a level
    controller.observe_round(9, forward_s(9), 2, 16e-3, 0.0, 4)  # a tree of 8 nodes over 2 levels: four rows
    assert rows_per_level(8, 2) == 4 and rows_per_level(2, 2) == 1 and rows_per_level(0, 0) == 0
    assert controller.choose([Candidate(fixed_tracker(0.6, 2), 2, tree_nodes=8)]) == [0]
    assert controller.cost.seconds(9, 2, 4) == pytest.approx(30e-3)
    assert controller.choose([Candidate(fixed_tracker(0.6, 2), 2)]) == [2]


def test_a_prompt_lookup_chain_is_priced_without_draft_levels() -> None:
    """Worked example, a flat 10 ms forward and 5 ms per draft level: the model's one-level draft at 0.3 commits
    1.3 tokens in 15 ms (87 tokens/s, under plain steps' 100), so it is not taken; the same request's lookup chain at
    0.9 by position commits 1 + 0.9 + 0.81 + 0.729 + 0.6561 = 4.1 tokens in 10 ms, whole. A drafter call of 40 ms
    (disaggregated) prices it at 4.1 / 50 ms = 82 tokens/s: not taken either."""
    controller = controller_with(lambda positions: 10.0, draft_level_ms=5.0, max_length=4)
    assert controller.choose([Candidate(fixed_tracker(0.3, 4), 4)]) == [0]
    lookup = Candidate(fixed_tracker(0.9, 4), 4, model_free=True)
    assert controller.choose([lookup]) == [4]
    assert controller.choose([lookup, Candidate(fixed_tracker(0.3, 4), 4)]) == [4, 0]
    controller.cost.draft_call_s.add(0.040)
    assert controller.choose([lookup]) == [0]


def test_a_lookup_verdict_moves_the_lookup_estimate_not_the_models() -> None:
    controller = SpeculationController(4)
    tracker = controller.tracker()
    tracker.lookup = controller.lookup_tracker()
    model_rates, lookup_rates = tracker.rates(), tracker.lookup.rates()
    controller.observe_verdict(tracker, 4, 4, model_free=True)
    assert tracker.rates() == model_rates and tracker.lookup.rates()[0] > lookup_rates[0]
    assert controller.lookup_population.rates()[0] > controller.population.rates()[0]
    assert tracker.idle_rounds == 0 and not tracker.caught_up  # a draft, by no model
    controller.observe_verdict(tracker, 2, 0)
    assert tracker.rates()[0] < model_rates[0] and tracker.lookup.rates()[0] > lookup_rates[0]


def test_a_lookup_chain_not_taken_fades_its_estimate_and_is_probed_again() -> None:
    """A request's lookup chains that were all rejected are not drafted; each round one is declined counts as idle
    for that estimate (no verdict will), which fades back to its prior, and after ``probe_every`` such rounds the
    chain is probed with one token."""
    controller = controller_with(lambda positions: 10.0 + positions, max_length=4)
    lookup = AcceptanceTracker([0.5] * 4, prior_weight=1.0)
    for _ in range(6):
        lookup.observe(4, 0)
    low = lookup.rates()[0]
    candidate = Candidate(lookup, 4, model_free=True)
    chosen = [controller.choose([candidate])[0] for _ in range(controller.probe_every + 1)]
    assert chosen[: controller.probe_every] == [0] * controller.probe_every and chosen[-1] == 1
    assert lookup.rates()[0] > low
