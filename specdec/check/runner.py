"""``specdec check``'s procedure against one live router: greedy identity, then the law at T > 0, with power shown.

1. **Greedy identity.** Every prompt is generated at temperature 0 with speculation off and under every
   configuration (drafter kind × mode); any configuration whose tokens differ from the off run is reported with
   the prompt and the first differing position (DESIGN §3: in float32 greedy output must match token for token).
2. **Law at T > 0.** For the first ``distribution_prompts`` prompts and every sampling setting, each configuration
   draws seeded generations of ``tokens`` tokens with speculation on; the :class:`LawSource` supplies the target's
   law for the same prompt and setting and compares (:mod:`specdec.check.stats`: per (position, prefix) tables,
   tail pooled, χ² or exact, Holm within a configuration). Configurations are then Bonferroni-adjusted for their
   number, so ``significance`` bounds the chance that a correct deployment fails the run.
3. **Power, shown.** Beside each real comparison the same procedure runs against a deliberately wrong law (the
   target's at ``control_temperature_factor`` × T). A configuration *passes* only when its real comparison is not
   rejected **and** the wrong law is: otherwise the budget could not have seen a distortion of that size and the
   verdict is *underpowered*.

Requests are interleaved across all samples (round robin), so a ``minutes`` budget that runs out leaves every
sample about equally large. Seeds are distinct per request and disjoint between samples.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdec.check.backends import Backend, CheckRequestError, Generation, Prompt
from specdec.check.stats import Outcome, SequenceTest, bonferroni, outcome, sequence_test

OFF: dict[str, Any] = {"speculation": "off"}
SEED_STRIDE = 1_000_003  # seeds of sample i: base + i * stride + j, disjoint while a sample has < stride requests
UINT63 = (1 << 63) - 1


# --- what is checked ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """A sampling setting (temperature > 0) of the distribution test."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"a distribution setting needs temperature > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @classmethod
    def parse(cls, text: str) -> Setting:
        """``"temperature=0.8,top_p=0.9,top_k=20"`` (keys may be shortened to ``t``, ``p``, ``k``)."""
        names = {"t": "temperature", "temperature": "temperature", "p": "top_p", "top_p": "top_p"}
        names |= {"k": "top_k", "top_k": "top_k"}
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            if key.strip() not in names or not value:
                raise ValueError(f"bad sampling setting {text!r}: use temperature=T[,top_p=P][,top_k=K]")
            name = names[key.strip()]
            values[name] = int(value) if name == "top_k" else float(value)
        if "temperature" not in values:
            raise ValueError(f"bad sampling setting {text!r}: temperature is required")
        return cls(**values)

    def options(self, temperature_factor: float = 1.0) -> dict[str, Any]:
        return {"temperature": self.temperature * temperature_factor, "top_p": self.top_p, "top_k": self.top_k}

    @property
    def label(self) -> str:
        parts = [f"T={self.temperature:g}"]
        if self.top_p < 1:
            parts.append(f"top_p={self.top_p:g}")
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        return " ".join(parts)


DEFAULT_SETTINGS = (Setting(1.0), Setting(0.7, top_p=0.9), Setting(1.0, top_k=20))


@dataclass(frozen=True)
class Mode:
    """One speculation configuration: drafter kind (``""``: the router's default) and mode.

    ``speculation`` is ``sequential``, ``pipelined`` or ``auto``; ``tree_width > 1`` drafts trees (the router
    runs them sequentially). ``num_draft_tokens`` 0 leaves γ (or the tree depth) to the router.
    """

    drafter: str
    speculation: str
    num_draft_tokens: int = 0
    tree_width: int = 0

    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"speculation": self.speculation}
        if self.drafter:
            options["drafter"] = self.drafter
        if self.num_draft_tokens:
            options["num_draft_tokens"] = self.num_draft_tokens
        if self.tree_width > 1:
            options["tree_width"] = self.tree_width
        return options

    @property
    def label(self) -> str:
        gamma = f"γ={self.num_draft_tokens}" if self.num_draft_tokens else "γ=default"
        shape = f"tree w={self.tree_width} {gamma}" if self.tree_width > 1 else f"{self.speculation} {gamma}"
        return f"{self.drafter or 'default'}/{shape}"


def modes_for(
    kinds: Sequence[str], names: Sequence[str], *, num_draft_tokens: int, tree_width: int, tree_depth: int
) -> tuple[Mode, ...]:
    """Every ``names`` mode (sequential, pipelined, tree, auto) for every drafter kind."""
    modes = []
    for kind in kinds:
        for name in names:
            if name == "tree":
                modes.append(Mode(kind, "sequential", tree_depth, tree_width))
            elif name in ("sequential", "pipelined", "auto"):
                modes.append(Mode(kind, name, num_draft_tokens))
            else:
                raise ValueError(f"unknown mode {name!r}: one of sequential, pipelined, tree, auto")
    return tuple(modes)


@dataclass(frozen=True)
class CheckConfig:
    """The whole check. ``requests`` / ``minutes`` bound it (whichever is reached first; at least one is set)."""

    prompts: tuple[Prompt, ...]
    modes: tuple[Mode, ...]
    settings: tuple[Setting, ...] = DEFAULT_SETTINGS
    distribution_prompts: int = 2
    tokens: int = 3
    greedy_tokens: int = 32
    requests: int | None = 3000
    minutes: float | None = None
    significance: float = 0.01
    control_temperature_factor: float = 0.8
    min_count: int = 5
    tail_min: int = 5
    concurrency: int = 16
    seed: int = 0
    chat: bool = False
    greedy: bool = True
    distribution: bool = True

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("no prompts")
        if not self.modes:
            raise ValueError("no speculation configuration to check (the router lists no drafter; pass --drafters)")
        if self.requests is None and self.minutes is None:
            raise ValueError("set a budget: requests and/or minutes")
        if not 0 < self.significance < 1:
            raise ValueError(f"significance must be in (0, 1), got {self.significance}")
        if self.control_temperature_factor <= 0 or self.control_temperature_factor == 1:
            raise ValueError("control_temperature_factor must be > 0 and != 1 (it must give a different law)")
        if self.tokens < 1 or self.greedy_tokens < 1 or self.concurrency < 1:
            raise ValueError("tokens, greedy_tokens and concurrency must be >= 1")


# --- where the target's law comes from ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """Requests of one kind (``key``) for one prompt: the generation options, and the outcomes gathered."""

    key: str
    prompt: Prompt
    options: dict[str, Any]
    max_tokens: int
    seed_base: int
    outcomes: list[Outcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Comparison:
    """A configuration's sample against the target's law (``real``) and against a wrong law (``control``)."""

    real: SequenceTest
    control: SequenceTest


class LawSource(Protocol):
    """Where the target's law for one (prompt, setting) comes from, and how a sample is compared with it.

    :class:`OffModeSamples` is the one route today (two-sample tests against speculation-off generations of the
    same router). A router that returns ``top_logprobs`` with the processed ``p`` could give the law itself: a
    one-sample goodness-of-fit route would then need far fewer reference requests, and would plug in here.
    """

    description: str

    def references(self, prompt: Prompt, setting: Setting) -> dict[str, dict[str, Any]]:
        """The reference samples it needs (name → generation options), drawn like the configurations' samples."""
        ...

    def compare(self, sample: Sample, references: dict[str, Sample]) -> Comparison: ...


@dataclass(frozen=True)
class OffModeSamples:
    """The target's law as generations with speculation off; the wrong law at ``control_factor`` × T."""

    tokens: int
    control_factor: float
    min_count: int = 5
    tail_min: int = 5

    @property
    def description(self) -> str:
        return (
            "two-sample test against speculation-off generations of the same router (wrong law: speculation off at "
            f"{self.control_factor:g} × T)"
        )

    def references(self, prompt: Prompt, setting: Setting) -> dict[str, dict[str, Any]]:
        return {"off": OFF | setting.options(), "control": OFF | setting.options(self.control_factor)}

    def compare(self, sample: Sample, references: dict[str, Sample]) -> Comparison:
        def test(reference: Sample, seed: int) -> SequenceTest:
            return sequence_test(
                sample.outcomes,
                reference.outcomes,
                self.tokens,
                min_count=self.min_count,
                tail_min=self.tail_min,
                seed=seed,
            )

        return Comparison(test(references["off"], sample.seed_base), test(references["control"], sample.seed_base + 1))


# --- results --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GreedyMismatch:
    prompt: str
    mode: str
    position: int  # first differing token index (the shorter length when one is a prefix of the other)
    off_tokens: list[Any]
    mode_tokens: list[Any]


@dataclass(frozen=True)
class ConfigurationResult:
    """One (prompt, setting, configuration) of the distribution test; ``status`` pass, fail or underpowered."""

    prompt: str
    setting: str
    mode: str
    comparison: Comparison
    family: int
    significance: float
    errors: int

    @property
    def adjusted_p(self) -> float:
        return bonferroni(self.comparison.real.p_value, self.family)

    @property
    def control_adjusted_p(self) -> float:
        return bonferroni(self.comparison.control.p_value, self.family)

    @property
    def status(self) -> str:
        if self.adjusted_p < self.significance:
            return "fail"
        return "pass" if self.control_adjusted_p < self.significance else "underpowered"


@dataclass
class CheckResult:
    target: str
    config: CheckConfig
    law: str
    greedy: list[GreedyMismatch] = field(default_factory=list)
    greedy_checked: int = 0
    distribution: list[ConfigurationResult] = field(default_factory=list)
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    budget_exhausted_by: str = ""

    @property
    def verdict(self) -> str:
        """``fail`` (a greedy mismatch, a rejected law or failed requests), ``underpowered`` or ``pass``."""
        if self.greedy or self.errors or any(r.status == "fail" for r in self.distribution):
            return "fail"
        if any(r.status == "underpowered" for r in self.distribution):
            return "underpowered"
        return "pass"

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": 1, "underpowered": 3}[self.verdict]


# --- running --------------------------------------------------------------------------------------------------


@dataclass
class _Budget:
    requests: int | None
    deadline: float | None
    used: int = 0

    def spent(self) -> str:
        if self.requests is not None and self.used >= self.requests:
            return "requests"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "minutes"
        return ""


async def _run_jobs(
    backend: Backend,
    jobs: Iterator[tuple[Sample, int]],
    *,
    chat: bool,
    concurrency: int,
    budget: _Budget,
    progress: Callable[[int], None],
) -> None:
    """Run ``(sample, index)`` jobs in order, ``concurrency`` at a time, until they or the budget run out."""
    lock = asyncio.Lock()

    async def worker() -> None:
        while True:
            async with lock:
                if budget.spent():
                    return
                job = next(jobs, None)
                if job is None:
                    return
                budget.used += 1
            sample, index = job
            options = sample.options | {
                "max_tokens": sample.max_tokens,
                "seed": (sample.seed_base + index) % UINT63,
            }
            try:
                generation: Generation = await backend.generate(sample.prompt, chat=chat, options=options)
            except CheckRequestError as error:
                sample.errors.append(str(error))
            else:
                sample.outcomes.append(outcome(generation.tokens, sample.max_tokens, generation.finished))
            progress(1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def _round_robin(samples: Sequence[Sample], per_sample: int | None) -> Iterator[tuple[Sample, int]]:
    index = 0
    while per_sample is None or index < per_sample:
        for sample in samples:
            yield sample, index
        index += 1


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def plan_distribution(config: CheckConfig, law: LawSource) -> tuple[list[Sample], list[tuple[str, str, str, Sample]]]:
    """Every sample the distribution test draws: per (prompt, setting) the law source's references, then one sample
    per configuration. Returns all samples (in round-robin order) and (prompt, setting, mode, sample) of the
    configurations."""
    samples: list[Sample] = []
    configured: list[tuple[str, str, str, Sample]] = []

    def new(key: str, prompt: Prompt, options: dict[str, Any]) -> Sample:
        base = config.seed + 1 + len(samples) * SEED_STRIDE
        sample = Sample(key, prompt, options, config.tokens, base)
        samples.append(sample)
        return sample

    for prompt in config.prompts[: config.distribution_prompts]:
        for setting in config.settings:
            for name, options in law.references(prompt, setting).items():
                new(f"{prompt.label}|{setting.label}|{name}", prompt, options)
            for mode in config.modes:
                sample = new(f"{prompt.label}|{setting.label}|{mode.label}", prompt, mode.options() | setting.options())
                configured.append((prompt.label, setting.label, mode.label, sample))
    return samples, configured


async def run_check(
    backend: Backend, config: CheckConfig, *, target: str, law: LawSource | None = None, progress: bool = True
) -> CheckResult:
    """The whole check against ``backend`` (module docstring)."""
    from tqdm import tqdm

    law = law or OffModeSamples(config.tokens, config.control_temperature_factor, config.min_count, config.tail_min)
    started = time.monotonic()
    deadline = started + config.minutes * 60 if config.minutes is not None else None
    budget = _Budget(config.requests, deadline)
    result = CheckResult(target, config, law.description)
    greedy: list[Sample] = []
    if config.greedy:
        for prompt in config.prompts:
            for key, options in [("off", OFF), *((mode.label, mode.options()) for mode in config.modes)]:
                greedy.append(Sample(key, prompt, options | {"temperature": 0.0}, config.greedy_tokens, config.seed))
    samples, configured = plan_distribution(config, law) if config.distribution else ([], [])
    per_sample = None
    if config.requests is not None and samples:
        per_sample = (config.requests - len(greedy)) // len(samples)
        if per_sample < config.min_count * 2:
            raise ValueError(
                f"--requests {config.requests} leaves {per_sample} requests for each of the {len(samples)} samples "
                f"of the distribution test (after {len(greedy)} greedy requests); need at least {config.min_count * 2}"
                " each: raise --requests, or check fewer prompts, settings or modes"
            )
    if not samples:
        total: int | None = len(greedy)
    else:
        total = len(greedy) + per_sample * len(samples) if per_sample is not None else None
    bar = tqdm(total=total or None, desc="specdec check", unit="req", disable=not progress)
    try:
        if greedy:
            await _run_jobs(
                backend,
                ((sample, 0) for sample in greedy),
                chat=config.chat,
                concurrency=config.concurrency,
                budget=_Budget(None, deadline),
                progress=bar.update,
            )
            budget.used += len(greedy)
        if samples:
            await _run_jobs(
                backend,
                _round_robin(samples, per_sample),
                chat=config.chat,
                concurrency=config.concurrency,
                budget=budget,
                progress=bar.update,
            )
    finally:
        bar.close()
    result.requests = budget.used
    result.budget_exhausted_by = budget.spent() or "plan"
    result.errors = [f"{sample.key}: {error}" for sample in greedy + samples for error in sample.errors]
    _greedy_results(result, greedy)
    by_key = {sample.key: sample for sample in samples}
    family = len(configured)
    for prompt, setting, mode, sample in configured:
        references = {
            name: by_key[f"{prompt}|{setting}|{name}"]
            for name in law.references(sample.prompt, _setting_of(config, setting))
        }
        comparison = law.compare(sample, references)
        result.distribution.append(
            ConfigurationResult(prompt, setting, mode, comparison, family, config.significance, len(sample.errors))
        )
    result.elapsed_s = time.monotonic() - started
    return result


def _setting_of(config: CheckConfig, label: str) -> Setting:
    return next(setting for setting in config.settings if setting.label == label)


def _greedy_results(result: CheckResult, greedy: list[Sample]) -> None:
    by_prompt: dict[str, dict[str, Sample]] = {}
    for sample in greedy:
        by_prompt.setdefault(sample.prompt.label, {})[sample.key] = sample
    for prompt, runs in by_prompt.items():
        off = runs.get("off")
        if off is None or not off.outcomes:
            continue
        for key, sample in runs.items():
            if key == "off" or not sample.outcomes:
                continue
            result.greedy_checked += 1
            position = _first_difference(off.outcomes[0], sample.outcomes[0])
            if position is not None:
                result.greedy.append(
                    GreedyMismatch(
                        prompt,
                        key,
                        position,
                        list(off.outcomes[0][position:][:8]),
                        list(sample.outcomes[0][position:][:8]),
                    )
                )


# --- reports --------------------------------------------------------------------------------------------------


def _table_json(item: Any) -> dict[str, Any]:
    table, test = item.table, item.test
    return {
        "position": table.position,
        "prefix": [str(token) for token in table.prefix],
        "tokens": [str(token) for token in table.tokens],
        "sample_counts": list(table.sample),
        "reference_counts": list(table.reference),
        "statistic": test.statistic,
        "df": test.df,
        "p_value": test.p_value,
        "method": test.method,
        "holm_p": item.adjusted_p,
    }


def _test_json(test: SequenceTest, family: int) -> dict[str, Any]:
    return {
        "p_value": test.p_value,
        "adjusted_p": bonferroni(test.p_value, family),
        "tables_tested": test.num_tables,
        "tables_untestable": test.untested_tables,
        "samples": list(test.samples),
        "tv_first_token": test.tv_first,
        "most_significant_tables": [_table_json(item) for item in test.tables[:3]],
    }


def report_json(result: CheckResult) -> dict[str, Any]:
    config = result.config
    return {
        "target": result.target,
        "verdict": result.verdict,
        "significance": config.significance,
        "law_source": result.law,
        "correction": (
            "Holm-Bonferroni over the (position, prefix) tables of a configuration; Bonferroni over the "
            f"{len(result.distribution)} configurations"
        ),
        "tokens": config.tokens,
        "requests": result.requests,
        "budget": {"requests": config.requests, "minutes": config.minutes, "exhausted_by": result.budget_exhausted_by},
        "elapsed_s": result.elapsed_s,
        "errors": result.errors[:20],
        "error_count": len(result.errors),
        "greedy": {
            "compared": result.greedy_checked,
            "max_tokens": config.greedy_tokens,
            "mismatches": [
                vars(m) | {"off_tokens": [str(t) for t in m.off_tokens], "mode_tokens": [str(t) for t in m.mode_tokens]}
                for m in result.greedy
            ],
        },
        "distribution": [
            {
                "prompt": r.prompt,
                "setting": r.setting,
                "mode": r.mode,
                "status": r.status,
                "errors": r.errors,
                "real": _test_json(r.comparison.real, r.family),
                "control": _test_json(r.comparison.control, r.family),
            }
            for r in result.distribution
        ],
    }


def _p(value: float) -> str:
    return f"{value:.3g}" if value >= 1e-3 or value == 0 else f"{value:.1e}"


def report_markdown(result: CheckResult) -> str:
    config = result.config
    lines = [
        f"# specdec check: {result.verdict.upper()}",
        "",
        f"Target `{result.target}`; {result.requests} requests in {result.elapsed_s:.0f} s "
        f"(budget: {config.requests or '∞'} requests, {config.minutes or '∞'} minutes; stopped by "
        f"{result.budget_exhausted_by}). Significance {config.significance:g} for the whole run.",
        "",
        "## Greedy identity",
        "",
    ]
    if not config.greedy:
        lines.append("Not run.")
    elif not result.greedy:
        lines.append(
            f"{result.greedy_checked} (prompt, configuration) pairs at temperature 0, {config.greedy_tokens} tokens: "
            "all identical to speculation off."
        )
    else:
        lines += ["| prompt | configuration | first differing position | off | on |", "|---|---|---|---|---|"]
        for m in result.greedy:
            lines.append(
                f"| {m.prompt} | {m.mode} | {m.position} | {' '.join(map(str, m.off_tokens))} | "
                f"{' '.join(map(str, m.mode_tokens))} |"
            )
    lines += ["", "## Distribution at T > 0", ""]
    if not result.distribution:
        lines.append("Not run.")
    else:
        lines += [
            f"Law source: {result.law}. The first {config.tokens} tokens; each (position, prefix) seen ≥ "
            f"{config.min_count} times in both samples is a 2 × K table (tokens with < {config.tail_min} pooled "
            "into a tail), tested by χ² (exact conditional test where an expected count is < 5); Holm–Bonferroni "
            f"over the tables of a configuration, then Bonferroni over the {len(result.distribution)} "
            "configurations (p below is adjusted). *pass* needs p ≥ significance **and** the wrong law rejected.",
            "",
            "| prompt | setting | configuration | samples (on/off) | tables | p | wrong-law p | TV₁ on/off | status |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result.distribution:
            real = r.comparison.real
            lines.append(
                f"| {r.prompt} | {r.setting} | {r.mode} | {real.samples[0]}/{real.samples[1]} | {real.num_tables} | "
                f"{_p(r.adjusted_p)} | {_p(r.control_adjusted_p)} | {real.tv_first:.3f} | **{r.status}** |"
            )
        failing = [r for r in result.distribution if r.status == "fail"]
        for r in failing:
            worst = r.comparison.real.tables[0]
            lines += [
                "",
                f"Most deviant table of {r.prompt} / {r.setting} / {r.mode}: position {worst.table.position}, "
                f"prefix {list(map(str, worst.table.prefix))}, tokens {list(map(str, worst.table.tokens))}, "
                f"on {list(worst.table.sample)} vs off {list(worst.table.reference)} (p {_p(worst.test.p_value)}, "
                f"{worst.test.method}).",
            ]
    if result.errors:
        lines += ["", f"## Failed requests: {len(result.errors)}", ""]
        lines += [f"- {error}" for error in result.errors[:10]]
    return "\n".join(lines) + "\n"
