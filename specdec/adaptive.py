"""Adaptive speculation: each round, the draft lengths that maximise expected committed tokens per second.

A chain of length γ whose positions are accepted with conditional rates α_1..α_γ (position i is accepted given that
1..i-1 were) commits ``E(γ) = 1 + Σ_{k=1..γ} Π_{i≤k} α_i`` tokens per round in expectation: the round's last token
is always the target's. A greedy (dynamic) tree of b nodes commits ``1 + Σ_{r≤b} p_r``, ``p_r`` the acceptance of its
r-th most probable node (:class:`RankTracker`), so its budget is chosen node by node like a chain's length.
Verifying a batch whose requests draft γ_r takes about

    T = overhead_s + [draft_call_s + draft_level_s(R) · max_r γ_r] + forward_s(Σ_r (1 + γ_r))

seconds: a fixed cost per round (router, wire; not the wait for the verifier), for a round that drafts what calling
the drafter adds besides its drafting (disaggregated: the call's wire and its wait in the drafter's queue) and one
draft step per level (drafting is batched across sequences level by level) whose cost grows with the R rows drafted
in it (one per chain, a tree's frontier per tree: on a GPU barely, on a CPU nearly in proportion), and one target
forward over every position (the curve the verifier's forwards trace).
The forward's curve starts, where the verifier times its forwards before it serves (:mod:`specdec.calibration`),
from that ladder of sizes; without it a router that had seen only plain steps priced every larger forward like them.
The fixed cost is learnt from every round, and the drafter call's own cost is measured directly (the call's wall
time less the drafting it reports), never as the difference of two averages: under load a round's cost besides
its forward was mostly queueing for the verifier and grew with the load, and an average learnt from the rare
rounds that draft lagged it (at low load it was learnt), so drafting rounds looked the cheaper kind and the
controller drafted where it lost.
The wait for the verifier's forward to start (a disaggregated verifier reports it) is left out of the fixed cost
altogether: under load it is most of a round, and next to it every extra position looked cheap; what a draft costs
the other requests is its positions in the forward, which the forward's cost curve prices. (On the CPU stack at
1.5 QPS ``auto`` drafted 1.28 tokens a round and its median request took 1.7x off's; with the wait left out, 1.19
and 1.3x, a change inside that machine's noise: ``bench/results/sweep-auto-1.2m/``.)
:class:`SpeculationController` picks the γ_r that maximise the batch's goodput ``Σ_r E_r(γ_r) / T`` (SmartSpec's
objective), from each request's measured, decayed acceptance by position (:class:`AcceptanceTracker`) and the
measured costs (:class:`CostCurve`, :class:`RoundCost`). When verification is the bottleneck and a drafted
token costs more time than it commits, every γ_r is 0: plain target steps. Whether a round that drafts should also
pre-draft the next proposal while it is verified is a second choice (:meth:`SpeculationController.pipelining_pays`):
a pre-draft defers the bonus token of a whole acceptance, so it pays only where the drafting it hides costs more.

Speculation must also clear a margin (``min_gain``, 5 % by default): a choice predicted to beat plain target steps
by less is not taken. The costs are wall-clock measurements, noisy on a shared machine, and a drafter that is only
about as fast as the target (an EAGLE head on a CPU) would otherwise flip between drafting and not on the noise,
paying the worse configuration half the time; where speculation pays (1.5-3× on a GPU) the margin costs nothing.

A request that has not drafted for ``probe_every`` rounds (16 by default) drafts one level anyway: its acceptance
estimate moves only on evidence, and so does the population's, which every new request starts from. A new request
is due a probe at once: the population follows the last requests, and after a short greeting whose two drafts were
rejected (``make demo``'s warm-up) it stood at 0.25 by position, so the next request drafted nothing for 24 of its
43 rounds and ran 0.70x as fast as sequential speculation, on a prompt the head drafts well. Without the
probe a few early rejections (a short greeting, say) would keep the router from ever drafting again. Nor should two
rejections set the population: it starts from ``population_prior_weight`` (8) observations at ``prior_rate``, not 2,
so that greeting leaves it at 0.4, not 0.25 (at 0.25 the first probe of the next request was rejected, and the
request then drafted nothing for 50 of its 52 rounds: 0.62x of sequential speculation). And a request's own estimate
starts from the population as ``request_prior_weight`` (4) observations: at 2, the rejection of a request's first
draft took it from 0.4 to 0.27, where the drafter call's cost (2.7 ms on a 22 ms forward) made no draft pay, and the
request drafted nothing until its next probe (7-38 rounds, 0.65-0.86x of sequential speculation). Each probe that
accepts nothing doubles the request's wait for the next (up to ``PROBE_BACKOFF_DOUBLINGS`` times: 128 rounds), and a
round that accepts anything resets it: a probe is not free (on a CPU an EAGLE drafter's first draft of a request
runs its head over the whole prompt, and the forward grows by a position), and with a draft that never paid, the
probes were what kept ``auto`` below speculation off under load here (``bench/results/auto-under-load.md``).

A draft level's cost is learnt only from rounds whose request drafted the round before too. A draft after plain
rounds also catches the drafter up on every token committed meanwhile (an EAGLE head runs over them), so on the CPU
stack a one-level probe reported 3.6-4 ms where a level costs 0.8: priced as levels, those probes (the only drafts
``auto`` made) kept it from drafting at all while sequential speculation ran 1.0-1.4x faster than off. Nor is a
level's cost learnt from a model-free proposal (an eagle drafter's prompt-lookup round: 0.02 ms for "4 levels"), or
from the draft after one, which catches up on what it committed.

A drafter that proposes prompt-lookup chains besides its model's drafts (an eagle drafter: a round whose text ends in
a tail seen earlier in it copies what followed, :mod:`specdec.lookup`) reports its ``lookup_min_match``, and the
router or engine that plans its rounds computes the same chain from the text, so a round that will be a lookup chain
is planned as one (``Candidate.model_free``): with the request's own estimate of its lookup chains (its tracker's
``lookup``, from the population's, which only lookup verdicts move) and no draft level to pay, only the drafter call.
Planned as the model's draft, such rounds were chosen by the model's acceptance: with the demo's small head (held-out
τ 1.44) ``auto`` drafted one or two tokens where a lookup chain of four would have been accepted, and ran 0.95-1.01x of
sequential speculation; planned as lookups, 1.05-1.07x (``bench/results/auto-lookup-demo-head.md``; the full head:
level). A lookup candidate that is declined fades its estimate (no verdict will) and, like an idle request, is probed
after ``probe_every`` rounds.

The choice is a control decision only: whatever proposal goes out, the verifier's acceptance rule keeps the output
distribution exactly the target's, so no choice here can change what is sampled.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

PROBE_BACKOFF_DOUBLINGS = 3  # the wait between failed probes of a request grows to at most 8 x probe_every
PRIOR_FORWARD_S = 0.01  # a guess at a one-position forward until one is measured
PRIOR_SLOPE = 0.125  # ...and at what each further position adds, relative to it (then scaled by measurements)
FULL_SAMPLES = 4  # a count measured fewer times is priced partly by the line through every count
RECENT_SAMPLES = 10  # a cost curve's count costs the mean of the lower three quarters of its last this many samples


class MovingAverage:
    """An exponential moving average; ``value`` is ``initial`` until the first sample."""

    def __init__(self, initial: float = 0.0, smoothing: float = 0.2) -> None:
        self.value = initial
        self.samples = 0
        self._smoothing = smoothing

    def add(self, sample: float) -> None:
        self.value = sample if self.samples == 0 else self.value + self._smoothing * (sample - self.value)
        self.samples += 1


class CostCurve:
    """Seconds of one step against a count, learnt from measurements: a target forward against the positions in it,
    a draft level against the rows drafted in it.

    A count costs the mean of the lower three quarters of its last ``RECENT_SAMPLES`` measurements. A pause that has
    nothing to do with the count (the process preempted, a collection) only ever makes a forward slower, and a moving
    average kept it: on the CPU stack one 85 ms forward among 25 ms ones priced 4 positions at 37 ms, after which the
    controller never chose that many again, so nothing corrected it, and ``auto`` drafted 1-2 tokens a round where
    sequential speculation's 4 ran 12 % faster. The trimmed mean still follows a real change within a window, and
    averages the ordinary noise about as a moving average did. A count measured fewer than ``FULL_SAMPLES`` times
    fills its missing samples from the least-squares line through every count (weighted by their measurements):
    the controller measures again only the counts it chooses, so one slow first forward of a size kept it from
    choosing that size (on the CPU stack a first 5-position forward of 34 ms, where 2 positions took 24, made 4 drafted
    tokens look dearer than 1 for the next 14 rounds). A query between measured counts interpolates
    linearly; past either end it goes on from the nearest measured count along the least-squares slope of every
    measured count (never downhill): a slope fitted to all the points, not to the two nearest, so a noisy
    pair cannot make one more position look free or dear. Below the smallest measured count it never falls under
    that count's cost per position times the positions (a steep slope would otherwise price a short forward at 0).
    Before two counts are measured the curve is the line ``prior_s · (1 + PRIOR_SLOPE · (n - 1))``, scaled through
    the count measured, if any.
    """

    def __init__(self, prior_s: float = PRIOR_FORWARD_S) -> None:
        self._prior_s = prior_s
        self._positions: list[int] = []  # sorted measured counts
        self._recent: dict[int, deque[float]] = {}
        self._values: dict[int, float] = {}  # each count's cost from its recent measurements
        self._estimates: dict[int, float] | None = None  # what each count is priced at (None: not computed since)

    def observe(self, positions: int, seconds: float) -> None:
        if positions < 1 or seconds <= 0:
            return
        recent = self._recent.get(positions)
        if recent is None:
            recent = self._recent[positions] = deque(maxlen=RECENT_SAMPLES)
            bisect.insort(self._positions, positions)
        recent.append(seconds)
        kept = sorted(recent)[: max(len(recent) * 3 // 4, 1)]
        self._values[positions] = sum(kept) / len(kept)
        self._estimates = None

    def points(self) -> list[tuple[int, float]]:
        """The measured curve: (positions, seconds) by increasing positions."""
        return [(n, self._values[n]) for n in self._positions]

    def seconds(self, positions: int) -> float:
        known = self._positions
        if len(known) < 2:
            scale = self._prior_s if not known else self._values[known[0]] / self._prior_line(known[0])
            return scale * self._prior_line(positions)
        values = self._estimated()
        index = bisect.bisect_left(known, positions)
        if 0 < index < len(known):
            low, high = known[index - 1], known[index]
            low_s, high_s = values[low], values[high]
            return low_s + (high_s - low_s) * (positions - low) / (high - low)
        if index == 0 and known[0] == positions:
            return values[positions]
        nearest = known[0] if index == 0 else known[-1]
        extended = values[nearest] + self._slope() * (positions - nearest)
        if index == 0:  # below every measured count the line may cross 0; a forward's cost per position does not
            return max(extended, values[nearest] * positions / nearest)  # fall as the forward shrinks
        return extended

    def _estimated(self) -> dict[int, float]:
        """Each measured count's price: its own cost, its missing samples (below ``FULL_SAMPLES``) filled from the
        weighted least-squares line through every count."""
        if self._estimates is None:
            counts = {n: len(self._recent[n]) for n in self._positions}
            intercept, slope = _line([(n, self._values[n], counts[n]) for n in self._positions])
            self._estimates = {
                n: (k * self._values[n] + max(FULL_SAMPLES - k, 0) * (intercept + slope * n)) / max(k, FULL_SAMPLES)
                for n, k in counts.items()
            }
        return self._estimates

    def _slope(self) -> float:
        return _line([(n, s, 1) for n, s in self._estimated().items()])[1]

    @staticmethod
    def _prior_line(positions: int) -> float:
        return 1 + PRIOR_SLOPE * (positions - 1)


def _line(points: Sequence[tuple[int, float, int]]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line through ``(count, seconds, weight)`` points (at least two
    counts), the slope never below 0 (a step never gets cheaper with more in it)."""
    total = sum(w for _, _, w in points)
    mean_n = sum(n * w for n, _, w in points) / total
    mean_s = sum(s * w for _, s, w in points) / total
    spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
    slope = max(sum(w * (n - mean_n) * (s - mean_s) for n, s, w in points) / spread, 0.0)
    return mean_s - slope * mean_n, slope


def rows_per_level(nodes: int, depth: int) -> int:
    """Rows one sequence's draft of ``nodes`` nodes ``depth`` levels deep puts into each draft level, on average: 1 for
    a chain, a tree's frontier (its nodes spread over its levels) for a tree; 0 for no draft."""
    return -(-nodes // depth) if depth > 0 and nodes > 0 else 0


def drafted_work(nodes: int, depth: int, dynamic_tree: tuple[int, int] | None = None) -> tuple[int, int]:
    """The draft levels a sent draft of ``nodes`` nodes ``depth`` levels deep cost, and its rows per level: the one
    rule :meth:`SpeculationController.choose` prices drafts by and rounds are measured by, so that what a round is
    measured against is what the next is planned with. A dynamic tree (``dynamic_tree``: the depth and nodes of its
    whole shape) cut to its best ``nodes`` ran ``min(depth, nodes)`` levels of the whole tree's rows, whatever shape
    the kept nodes make: its drafter expands the likeliest nodes of every level and keeps the best afterwards. (Taken
    as the cut tree's own depth and rows, a cut to two siblings charged two levels' time to one.) Any other draft:
    its own depth, :func:`rows_per_level`."""
    if dynamic_tree is None or nodes < 1:
        return depth, rows_per_level(nodes, depth)
    whole_depth, whole_nodes = dynamic_tree
    return min(whole_depth, nodes), rows_per_level(whole_nodes, whole_depth)


@dataclass
class RoundCost:
    """What a round costs besides its forward: per draft level, fixed (router, wire: every round), and
    what a round that drafts adds by calling the drafter (``draft_call_s``: 0 co-located, and until measured)."""

    forward: CostCurve = field(default_factory=CostCurve)
    draft_level: CostCurve = field(default_factory=lambda: CostCurve(prior_s=0.0))  # by rows; free until measured
    overhead_s: MovingAverage = field(default_factory=MovingAverage)
    draft_call_s: MovingAverage = field(default_factory=MovingAverage)

    def seconds(self, positions: int, draft_levels: int, rows: int = 1, *, calls_drafter: bool = False) -> float:
        """A round with ``positions`` in its forward whose longest draft has ``draft_levels`` levels of ``rows``
        rows each (:func:`rows_per_level` summed over the sequences drafted together); ``calls_drafter``: it calls
        the drafter even with no level to draft (a prompt-lookup chain)."""
        level_s = self.draft_level.seconds(rows) if draft_levels else 0.0
        return (
            self.fixed_s(draft_levels, calls_drafter=calls_drafter)
            + level_s * draft_levels
            + self.forward.seconds(positions)
        )

    def fixed_s(self, draft_levels: int, *, calls_drafter: bool = False) -> float:
        """The fixed cost of a round that drafts ``draft_levels`` levels (0: a plain round, unless it
        ``calls_drafter``)."""
        calls = draft_levels > 0 or calls_drafter
        return self.overhead_s.value + (self.draft_call_s.value if calls else 0.0)


class AcceptanceTracker:
    """One request's acceptance by draft position: decayed counts of tries and acceptances, shrunk to a prior.

    Position i was *tried* in a round when the proposal reached depth i and positions 1..i-1 were accepted. The
    rate at i is ``(accepted_i + w · prior_i) / (tried_i + w)`` (``prior_i``: see :meth:`rates`). Every
    observation decays the old counts (``decay``), and so does a round with no proposal, so evidence of a request
    that stopped drafting fades back to the prior and the controller tries again.
    """

    def __init__(self, prior: Sequence[float], *, prior_weight: float = 2.0, decay: float = 0.95) -> None:
        self.prior = list(prior)
        self._weight = prior_weight
        self._decay = decay
        self._tried = [0.0] * len(self.prior)
        self._accepted = [0.0] * len(self.prior)
        self.idle_rounds = 0  # rounds since the request last drafted
        self.failed_probes = 0  # probes in a row that accepted nothing
        self.last_draft_model_free = False  # the last draft ran no model (prompt lookup)
        self.lookup: AcceptanceTracker | None = None  # its prompt-lookup chains, kept apart (module docstring)
        self.ranks: RankTracker | None = None  # its dynamic trees' nodes by rank, where it drafts them

    @property
    def max_length(self) -> int:
        return len(self.prior)

    @property
    def caught_up(self) -> bool:
        """Whether a draft now costs only its own levels: the request's last round drafted, with a model. A draft
        after plain or model-free rounds also runs the drafter over the tokens they committed (module docstring)."""
        return self.idle_rounds == 0 and not self.last_draft_model_free

    def observe(self, proposed: int, accepted: int) -> None:
        """A round that proposed a chain (or tree) ``proposed`` deep and accepted ``accepted`` positions."""
        self.fade()
        for position in range(min(accepted + 1, proposed, self.max_length)):
            self._tried[position] += 1
            self._accepted[position] += position < accepted

    def fade(self) -> None:
        """Decay the evidence (a round that proposed nothing)."""
        self._tried = [count * self._decay for count in self._tried]
        self._accepted = [count * self._decay for count in self._accepted]

    def idle(self) -> None:
        """A round of this estimate's request that drafted nothing of its kind: the evidence fades, one more idle
        round counts towards the next probe."""
        self.fade()
        if self.ranks is not None:
            self.ranks.fade()
        self.idle_rounds += 1

    def rates(self) -> list[float]:
        """α_1..α_max: the estimated acceptance rate of each position given the ones before it.

        Position 1 shrinks to ``prior[0]``, every later one to the estimate just before it: a position the request
        has not reached yet is expected to do as well as the deepest one measured, so the controller tries it
        (a fixed prior there would keep a well-accepted request from ever drafting deeper than it already has).
        """
        w, rates, prior = self._weight, [], self.prior[0]
        for accepted, tried in zip(self._accepted, self._tried, strict=True):
            prior = (accepted + w * prior) / (tried + w)
            rates.append(prior)
        return rates

    def gains(self, length: int) -> list[float]:
        """What each position adds to the expected committed tokens: ``Π_{i≤k} α_i`` for k = 1..length."""
        gains, reach = [], 1.0
        for rate in self.rates()[:length]:
            reach *= rate
            gains.append(reach)
        return gains

    def expected_tokens(self, length: int) -> float:
        """``E(length)``: tokens a round drafting ``length`` commits in expectation (1 with no draft)."""
        return 1 + sum(self.gains(length))


class RankTracker:
    """One request's acceptance of its dynamic trees' nodes by rank: ``p_r``, how often the tree's r-th most probable
    node is accepted (:meth:`specdec.drafters.model.TreeDraft.select` numbers a dynamic tree's nodes so).

    A dynamic tree's candidates do not depend on its budget, so the tree of budget b is the first b nodes of any
    larger one and commits ``E(b) = 1 + Σ_{r≤b} p_r`` tokens in expectation: the controller prices it node by node,
    as it prices a chain position by position, and picks its budget every round instead of sending the whole tree
    or nothing. Rank r was *tried* in a round whose tree had more than r nodes, and accepted when the verdict's path
    holds it; ``p_r = (accepted_r + w · target_r) / (tried_r + w)``, the counts decayed at every observation as
    :class:`AcceptanceTracker`'s. The target is ``prior[r]`` where the prior has one (a request's: what the population
    accepts), else the decline measured between the two ranks before goes on (``p_{r-1}² / p_{r-2}``; the population
    starts from one rate, so from a geometric prior): a rank nobody has tried is priced as the ones measured suggest,
    so it is tried where that pays (a fixed prior would keep trees from ever growing past the ranks once measured
    on a head that pays deeper), and rarely where the decline is steep (the previous rank's own rate, as a chain's
    deeper positions take, sends every request exploring deep nodes). These are marginal rates (a chain's are
    conditional). The ranks follow the draft's own path probability, which acceptance follows where the draft is
    calibrated, so the estimate is made non-increasing in rank (a running minimum): noise cannot make a later node
    look better than an earlier one, and the controller's best-gain-first order takes a prefix of the ranks.
    """

    def __init__(self, prior: Sequence[float], *, prior_weight: float = 2.0, decay: float = 0.95) -> None:
        if not prior:
            raise ValueError("a rank tracker needs a prior for its first rank")
        self.prior = list(prior)
        self._weight = prior_weight
        self._decay = decay
        self._tried: list[float] = []
        self._accepted: list[float] = []

    def observe(self, nodes: int, accepted: Sequence[int]) -> None:
        """A round whose tree had ``nodes`` nodes, of which the verdict accepted the ``accepted`` ones (a path)."""
        self.fade()
        missing = nodes - len(self._tried)
        if missing > 0:
            self._tried += [0.0] * missing
            self._accepted += [0.0] * missing
        for rank in range(nodes):
            self._tried[rank] += 1
        for rank in accepted:
            self._accepted[rank] += 1

    def fade(self) -> None:
        """Decay the evidence."""
        self._tried = [count * self._decay for count in self._tried]
        self._accepted = [count * self._decay for count in self._accepted]

    def rates(self, nodes: int | None = None) -> list[float]:
        """``p_1..p_nodes`` (None: every rank with a prior or an observation), non-increasing."""
        count = max(len(self.prior), len(self._tried)) if nodes is None else nodes
        w, rates = self._weight, [1.0]  # (a rank -1, accepted always: the running minimum's start)
        for rank in range(count):
            last, before = rates[-1], rates[-2] if len(rates) > 1 else 1.0
            target = self.prior[rank] if rank < len(self.prior) else (last * last / before if before > 0 else 0.0)
            tried, accepted = (self._tried[rank], self._accepted[rank]) if rank < len(self._tried) else (0.0, 0.0)
            rates.append(min(last, (accepted + w * target) / (tried + w)))
        return rates[1:]

    def gains(self, nodes: int) -> list[float]:
        """What each of the first ``nodes`` ranks adds to the expected committed tokens: ``p_r``."""
        return self.rates(nodes)


@dataclass(frozen=True)
class Candidate:
    """One request of the batch being planned: its tracker, the longest draft it may have this round, and for a
    tree the nodes its full tree holds (None: a chain, one node per level). A tree whose request keeps a rank
    estimate (``ranks``: its drafter grows dynamic trees) is priced node by node and may be cut to its best few
    nodes; any other tree is sent whole or not at all. ``model_free``: the draft is a prompt-lookup chain
    (``tracker`` is then the request's ``lookup`` tracker): it costs the drafter call but no draft level."""

    tracker: AcceptanceTracker
    max_length: int
    tree_nodes: int | None = None
    model_free: bool = False
    ranks: RankTracker | None = None

    @classmethod
    def for_round(cls, tracker: AcceptanceTracker, depth: int, nodes: int, *, tree: bool, lookup: int = 0) -> Candidate:
        """A request's round with room for ``nodes`` nodes of a draft ``depth`` deep (a chain: ``min(depth,
        nodes)``; a ``tree``: that tree, by rank where ``tracker`` keeps ``ranks``), or, when its drafter will propose
        a prompt-lookup chain of ``lookup`` tokens (and ``tracker`` keeps a lookup estimate), that chain."""
        if lookup and tracker.lookup is not None:
            return cls(tracker.lookup, lookup, model_free=True)
        return cls(tracker, depth, nodes, ranks=tracker.ranks) if tree else cls(tracker, min(depth, nodes))

    def node_budget(self, length: int) -> int:
        """The nodes to draft for a chosen ``length``: a chain's length, a tree's chosen nodes by rank (at most its
        room), or a tree's whole budget (0: none)."""
        if self.tree_nodes is None or not length:
            return length
        return min(length, self.tree_nodes) if self.ranks is not None else self.tree_nodes


class SpeculationController:
    """Chooses every request's draft length each round to maximise the batch's expected tokens per second.

    One controller serves one engine or one router: it learns the costs from every round it is told about, and
    the population's acceptance by position, which is the prior of each new request's tracker.
    """

    def __init__(
        self,
        max_length: int,
        *,
        prior_rate: float = 0.5,
        population_decay: float = 0.98,
        population_prior_weight: float = 8.0,
        request_prior_weight: float = 4.0,
        min_gain: float = 0.05,
        probe_every: int = 16,
    ) -> None:
        self.max_length = max_length
        self.min_gain = min_gain  # how much faster than plain target steps speculation must be predicted to be
        self.probe_every = probe_every  # a request idle this many rounds drafts one level to measure again
        self.cost = RoundCost()
        self.population = AcceptanceTracker(
            [prior_rate] * max_length, prior_weight=population_prior_weight, decay=population_decay
        )
        self.lookup_population = AcceptanceTracker(
            [prior_rate] * max_length, prior_weight=population_prior_weight, decay=population_decay
        )
        self.rank_population = RankTracker([prior_rate], prior_weight=population_prior_weight, decay=population_decay)
        self.request_prior_weight = request_prior_weight  # observations a new request's population prior counts as
        self.tokens_per_round = MovingAverage(initial=1.0)  # committed per sequence per round, all requests

    def learn_forward_costs(self, costs: Sequence[tuple[int, float]]) -> None:
        """Start the forward cost curve from ``(positions, seconds)`` timed elsewhere (a verifier times a ladder of
        sizes when it starts, :mod:`specdec.calibration`): each counts as one measurement, so forwards measured in
        rounds soon outweigh it."""
        for positions, seconds in costs:
            self.cost.forward.observe(positions, seconds)

    def tracker(self) -> AcceptanceTracker:
        """A new request's tracker, starting from what the population accepts, and due a probe: where the population
        says drafting does not pay, the request drafts one level to see for itself (module docstring)."""
        tracker = AcceptanceTracker(self.population.rates(), prior_weight=self.request_prior_weight)
        tracker.idle_rounds = self.probe_every
        return tracker

    def lookup_tracker(self) -> AcceptanceTracker:
        """A request's estimate of its prompt-lookup chains (its tracker's ``lookup``, for a drafter that proposes
        them besides its model's drafts), starting from what the population's lookup chains accept."""
        return AcceptanceTracker(self.lookup_population.rates(), prior_weight=self.request_prior_weight)

    def rank_tracker(self) -> RankTracker:
        """A request's estimate of its dynamic trees' nodes by rank (its tracker's ``ranks``, for a request whose
        drafter grows dynamic trees), starting from what the population's trees accept."""
        return RankTracker(self.rank_population.rates(), prior_weight=self.request_prior_weight)

    def observe_verdict(
        self,
        tracker: AcceptanceTracker,
        proposed: int,
        accepted: int,
        *,
        model_free: bool = False,
        nodes: int = 0,
        accepted_nodes: Sequence[int] = (),
    ) -> None:
        """A request's round: ``proposed`` draft levels (0: none), ``accepted`` of them accepted; ``model_free``: the
        draft ran no model (prompt lookup). For a request that keeps ``ranks``: its tree's ``nodes`` and the ones
        ``accepted_nodes`` (the verdict's path; a dynamic tree's node index is its rank)."""
        self.tokens_per_round.add(accepted + 1)
        if proposed == 0:
            tracker.idle()
            return
        probed = tracker.idle_rounds >= self.probe_wait(tracker)  # a draft after that long idle is a probe
        tracker.idle_rounds = 0
        tracker.last_draft_model_free = model_free
        if model_free and tracker.lookup is not None:  # a lookup chain says nothing of what the model drafts
            tracker.lookup.idle_rounds = 0
            tracker.lookup.observe(proposed, accepted)
            self.lookup_population.observe(proposed, accepted)
            return
        tracker.failed_probes = 0 if accepted else tracker.failed_probes + probed
        tracker.observe(proposed, accepted)
        self.population.observe(proposed, accepted)
        if tracker.ranks is not None and nodes:
            tracker.ranks.observe(nodes, accepted_nodes)
            self.rank_population.observe(nodes, accepted_nodes)

    def probe_wait(self, tracker: AcceptanceTracker) -> int:
        """Idle rounds after which ``tracker``'s request probes: ``probe_every``, doubled for each probe in a row that
        accepted nothing (at most ``PROBE_BACKOFF_DOUBLINGS`` times)."""
        return self.probe_every << min(tracker.failed_probes, PROBE_BACKOFF_DOUBLINGS)

    def observe_round(
        self,
        positions: int,
        forward_s: float,
        draft_levels: int,
        draft_s: float,
        other_s: float,
        rows: int = 1,
        call_s: float | None = None,
    ) -> None:
        """One measured round: a forward over ``positions`` that took ``forward_s``; ``draft_levels`` levels of
        ``rows`` rows each (:func:`rows_per_level`, summed over the sequences drafted together) drafted in ``draft_s``;
        ``other_s`` of the round's wall time was neither, nor the drafter call's ``call_s`` (its wall time less
        ``draft_s``; None: no call was waited for)."""
        self.cost.forward.observe(positions, forward_s)
        if draft_levels > 0:
            self.cost.draft_level.observe(max(rows, 1), draft_s / draft_levels)
        self.cost.overhead_s.add(max(other_s, 0.0))
        if call_s is not None:
            self.cost.draft_call_s.add(max(call_s, 0.0))

    def pipelining_pays(
        self,
        tracker: AcceptanceTracker,
        depth: int,
        positions: int,
        *,
        other_positions: int = 0,
        other_tokens: float = 0.0,
    ) -> bool:
        """Whether to pre-draft the next proposal while a proposal ``depth`` levels deep with ``positions`` nodes is
        verified (pipelined), rather than draft it after the verdict (sequential); the load is as in :meth:`choose`.

        A pre-draft assumes the proposal is accepted whole. Where it is (probability ``G = Π α`` over its depth) the
        next round's drafting is already done, but that verdict's bonus token is deferred: the next round's first
        drafted position is checked against its logits row, which the verifier holds, so that forward has one
        position fewer. Counting tokens per round, a pipelined round commits ``E − G`` where a sequential one
        commits ``E`` (at depth 1 a pipelined round always commits exactly one token, a plain target step's worth,
        on a larger forward). So pipelining pays only where the drafting it hides is worth more than the bonus::

            sequential  E / (fixed(drafting) + draft_level · depth + forward(1 + positions))
            pipelined   (E − G) / ((1 − G) · sequential round + G · (fixed(plain) + forward(positions)))

        (``fixed``: :meth:`RoundCost.fixed_s`; a round whose proposal was pre-drafted waits for no drafter.)
        """
        if depth < 1 or positions < 1:
            return False
        gains = tracker.gains(min(depth, tracker.max_length))
        expected, whole = 1 + sum(gains), gains[-1]
        sequential_s = self.cost.seconds(other_positions + 1 + positions, depth, rows_per_level(positions, depth))
        after_hit_s = self.cost.seconds(other_positions + positions, 0)  # drafted while the last round verified
        pipelined_s = (1 - whole) * sequential_s + whole * after_hit_s
        return (other_tokens + expected - whole) / pipelined_s > (other_tokens + expected) / sequential_s

    def choose(
        self,
        candidates: Sequence[Candidate],
        *,
        other_positions: int = 0,
        other_tokens: float = 0.0,
    ) -> list[int]:
        """Each candidate's draft length (0: a plain target step) for this round; for a tree priced by rank, its
        nodes.

        ``other_positions`` / ``other_tokens``: what sequences not planned here (other requests decided on their
        own, sharing the verifier's forward) add to it in positions and expected committed tokens.

        Each extra position of a request adds its gain ``Π α`` to the expected tokens, and gains fall along a chain,
        so the increments are taken best gain per position first and the best prefix of that order is kept. Were the
        round cost a function of the position count alone, that would be the optimum (among all choices with n
        positions the n best gains win); the draft term (the longest chain's levels) makes it a close heuristic.
        A dynamic tree's nodes are increments too, each its rank's ``p_r`` (:class:`RankTracker`; its first b nodes
        need ``min(depth, b)`` levels); another tree is one increment of its whole budget at its mean gain per node.
        A prefix predicted to beat no drafting by less than ``min_gain`` is not taken (module docstring). A
        model-free candidate (a prompt-lookup chain) adds positions and the drafter call, no draft level.
        """
        # (-gain per position, order within the request, request, positions added, draft levels, length it sets)
        increments: list[tuple[float, int, int, int, int, int]] = []
        # each request's rows per draft level, once it drafts; a cut dynamic tree's levels and rows are those of
        # drafted_work (the whole tree's rows), the rule its rounds are measured by
        rows_of = []
        for index, candidate in enumerate(candidates):
            length = min(candidate.max_length, candidate.tracker.max_length)
            nodes = candidate.tree_nodes
            dynamic = (length, nodes) if nodes is not None and candidate.ranks is not None else None
            rows_of.append(1 if nodes is None else drafted_work(nodes, length, dynamic)[1])
            if nodes is None:
                gains = candidate.tracker.gains(length)
                increments.extend((-gain, level, index, 1, level + 1, level + 1) for level, gain in enumerate(gains))
            elif length > 0 and candidate.ranks is not None:  # a dynamic tree: its best ``rank + 1`` nodes
                gains = candidate.ranks.gains(nodes)
                increments.extend(
                    (-gain, rank, index, 1, drafted_work(rank + 1, length, dynamic)[0], rank + 1)
                    for rank, gain in enumerate(gains)
                )
            elif length > 0 and nodes > 0:  # any other tree: whole
                gain = sum(candidate.tracker.gains(length))
                increments.append((-gain / nodes, 0, index, nodes, length, length))
        increments.sort()
        positions = other_positions + len(candidates)
        tokens = other_tokens + len(candidates)
        levels = 0
        best_rate = tokens / self.cost.seconds(positions, 0) * (1 + self.min_gain)
        best_prefix = 0
        drafting: set[int] = set()  # the requests the prefix drafts for: a level costs more the more rows it drafts
        rows = 0
        for taken, (negative_gain, _, index, added, draft_levels, _) in enumerate(increments, start=1):
            positions += added
            tokens += -negative_gain * added
            if not candidates[index].model_free:
                levels = max(levels, draft_levels)
                if index not in drafting:
                    drafting.add(index)
                    rows += rows_of[index]
            # every prefix calls the drafter: a model-free chain too, with no level to draft
            rate = tokens / self.cost.seconds(positions, levels, rows, calls_drafter=True)
            if rate > best_rate:
                best_rate, best_prefix = rate, taken
        lengths = [0] * len(candidates)
        for *_, index, _, _, length in increments[:best_prefix]:
            lengths[index] = max(lengths[index], length)
        for index, candidate in enumerate(candidates):  # a probe: the estimate of a request that stopped drafting
            tracker = candidate.tracker
            if lengths[index] or not candidate.max_length:
                continue
            if tracker.idle_rounds >= self.probe_wait(tracker):
                lengths[index] = 1  # (and the population prior new requests start from) can only move on evidence
            elif candidate.model_free:  # no verdict will tell this lookup estimate of the round: it fades here
                tracker.idle()
        return lengths
