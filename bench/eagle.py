"""EAGLE drafting co-located: acceptance by draft shape and sampling, speed against the baselines, training budgets.

The held-out prompts of the distillation set (:func:`specdec.distill.prompts.load_prompt_set` ``"heldout"``, the
first ``--num-prompts`` taking categories in turn) through the chat template; float32, batch size 1, EOS honoured,
one uncounted warm-up request per configuration, configurations interleaved prompt by prompt (drifting machine
load hits all alike). Sections (``--sections``, default all; ``budgets`` needs ``--budget-heads``):

* ``acceptance``: greedy and temperature 0.7 (seeded per prompt), chains γ = 2..6 and 8 and seven trees (depth 3,
  width 2 or 3, 4 nodes; depth 4, width 2, 3 or 4, 8 nodes; depth 5, width 2, and depth 6, width 3, 8 nodes: each
  verifies as many positions as chain γ=4 / γ=8; greedy trees are dynamic, sampled ones spread over their levels:
  :class:`specdec.drafters.model.TreeDraft`) of the head: acceptance rate, acc@i, mean accepted length, draft and
  target-forward cost;
* ``agreement``: the head's teacher-forced agreement as served, one draft at every position of the target's greedy
  answers, beside the held-out agreement its training reported, and split by whether the previous position agreed
  (:mod:`bench.eagle_agreement`): whether serving computes what training measured, and why ``acc@1`` is lower;
* ``speed``: greedy: target-only (and target-only over torch's own matrix multiplies, unpacked), ngram γ=4,
  Hugging Face prompt lookup γ=4, every eagle shape, γ=4 with the head's weights in bfloat16 (the target stays
  float32), the :data:`INT8_SHAPES` with its draft layers over int8 weights (``--draft-quantization int8``) and the
  :data:`LOOKUP_SHAPES` with int8 and prompt lookup (the eagle drafter's default; every other eagle row runs the head
  alone); then target-only vs eagle γ=4 (float32, int8, int8 + lookup) at temperature 0.7;
* ``trees``: greedy, the head as served (int8 draft layers, prompt lookup): chains γ = 3, 4 and 8 beside the dynamic
  trees of 4 nodes (depth 3, width 2 and 3) and of 8 (depth 4, width 2, 3 and 4; depth 5, width 2), and
  target-only;
* ``lookup``: per category, greedy and temperature 0.7, target-only against the ngram drafter and the int8 head at
  γ = 4 alone and with prompt lookup from each of ``--lookup-min-matches`` (the tail match that makes a round a
  lookup chain; default :data:`LOOKUP_MIN_MATCHES`);
* ``budgets``: each head of ``--budget-heads`` (e.g. ``specdec distill --snapshot-minutes`` copies) at γ = 4,
  greedy: training budget -> held-out mean accepted length.

Writes ``eagle.json`` and ``eagle.md`` (``eagle-SECTION-....*`` when ``--sections`` is given) into
``--output-dir`` after every section, so a run cut short keeps the sections it finished.

    python -m bench.eagle --num-prompts 24 --max-tokens 96 --output-dir bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import transformers

from bench.arguments import comma_ints
from bench.colocated import ConfigResult, Generate, compare, engine_generator, hf_generator
from bench.eagle_agreement import teacher_forced_agreement
from bench.load.report import cpu_model
from specdec.cache import default_head_dir
from specdec.distill.command import SUMMARY_FILE
from specdec.distill.data import encode_chat
from specdec.distill.prompts import LONG_CONTEXT, interleave_categories, load_prompt_set
from specdec.drafters import DraftConfig, Drafter, EagleDrafter, Proposal, build_drafter
from specdec.engine import Engine, GenerationRequest, GenerationResult, SpecStats
from specdec.errors import InvalidArgumentError
from specdec.models import LoadedModel, load_model, quiet_model_loading
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from specdec.verification import VerifyOutcome

SECTIONS = ("acceptance", "agreement", "speed", "trees", "lookup", "budgets")
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.7)
SAMPLINGS = {"greedy": GREEDY, "T=0.7": SAMPLED}
SHAPES = {  # each tree beside the chain that verifies as many positions (chain γ=4 / tree b4, chain γ=8 / tree b8)
    **{f"chain γ={gamma}": DraftConfig(num_draft_tokens=gamma) for gamma in (2, 3, 4, 5, 6, 8)},
    "tree d3 w2 b4": DraftConfig(num_draft_tokens=3, tree_width=2, tree_budget=4),
    "tree d4 w2 b8": DraftConfig(num_draft_tokens=4, tree_width=2, tree_budget=8),
    "tree d5 w2 b8": DraftConfig(num_draft_tokens=5, tree_width=2, tree_budget=8),
    "tree d4 w3 b8": DraftConfig(num_draft_tokens=4, tree_width=3, tree_budget=8),
    "tree d4 w4 b8": DraftConfig(num_draft_tokens=4, tree_width=4, tree_budget=8),
    "tree d6 w3 b8": DraftConfig(num_draft_tokens=6, tree_width=3, tree_budget=8),  # greedy: deeper where sure
    "tree d3 w3 b4": DraftConfig(num_draft_tokens=3, tree_width=3, tree_budget=4),
    "tree d4 w3 b4": DraftConfig(num_draft_tokens=4, tree_width=3, tree_budget=4),  # the router's default shape
}
BUDGET_SHAPE = "chain γ=4"
INT8_SHAPES = ("chain γ=2", "chain γ=3", BUDGET_SHAPE, "tree d3 w2 b4", "tree d4 w2 b8")  # speed rows, int8 head
LOOKUP_SHAPES = (BUDGET_SHAPE, "tree d3 w2 b4", "tree d4 w2 b8")  # ... int8 head + prompt lookup (served default)
TREE_SHAPES = (  # the trees section
    *("chain γ=3", BUDGET_SHAPE, "chain γ=8", "tree d3 w2 b4", "tree d3 w3 b4", "tree d4 w3 b4"),
    *("tree d4 w2 b8", "tree d4 w3 b8", "tree d4 w4 b8", "tree d5 w2 b8"),
)
LOOKUP_MIN_MATCHES = (0, 3, 5)  # the lookup section: the head alone, then prompt lookup from these tail matches
TRAINING_KEYS = ("features", "train_minutes", "data_minutes", "training_tokens", "tokens_seen")  # train-summary.json
MAX_DEPTH = max(config.num_draft_tokens for config in SHAPES.values())

DEFINITIONS = """\
- A **round** is one target forward: draft (possibly nothing), verify, commit. The first round of every request \
drafts nothing (the head drafts from the target's features, which arrive with the first verdict: the prompt's \
prefill; only a prompt-lookup row can draft it, from the prompt's text), and neither does a round with one token \
left to generate; these are the **undrafted** rounds.
- **acceptance rate** = accepted / drafted tokens; tree nodes count as drafted (never as accepted length), so a \
tree's rate is lower by construction.
- **acc@i** = the fraction of *drafted* rounds whose first i drafted tokens were all accepted (a tree: whose accepted \
path is at least i deep).
- **mean accepted length τ** = 1 + accepted / *drafted* rounds (undrafted rounds left out). **tokens/round** = \
1 + accepted / *all* rounds (DESIGN §7's mean accepted length, undrafted rounds counted): what a round really commits.
- **draft ms/token** = all draft time / drafted tokens. **target fwd ms** = verify time (target forward plus the \
acceptance rule) of the drafted rounds / drafted rounds: one forward over the pending token and the draft, the \
prefill excluded (the JSON's `verify_ms_per_round_all` is all verify time / all rounds, prefill included). \
**c** = draft ms/token ÷ target fwd ms.
- **tokens/s** = generated tokens / the sum of the requests' wall times (batch 1, warm-ups excluded).
- Sampled runs seed each request from its prompt (CRC-32 of the token ids), the same seed in every configuration.
"""


@dataclass(frozen=True)
class Prompt:
    """One held-out conversation, through the chat template."""

    id: str
    category: str
    token_ids: list[int]


@dataclass(frozen=True)
class Settings:
    """What the sections run: the head (None: the target's cached head), the length, the budget heads."""

    max_tokens: int = 96
    draft_model: str | None = None
    budget_heads: tuple[Path, ...] = ()
    lookup_min_matches: tuple[int, ...] = LOOKUP_MIN_MATCHES


@dataclass(frozen=True)
class RoundRecord:
    drafted: int  # nodes proposed
    accepted: int
    draft_s: float
    verify_s: float


class RecordingEngine(Engine):
    """The co-located engine keeping every round's counts and times (its :class:`SpecStats` keeps totals only);
    used at batch size 1, so the rounds since :attr:`rounds` was cleared are one request's."""

    def __init__(self, runner: KVRunner, eos_token_ids: frozenset[int], drafter: Drafter | None = None) -> None:
        super().__init__(runner, eos_token_ids, drafter)
        self.rounds: list[RoundRecord] = []

    def _record(
        self, sequence: Any, proposal: Proposal, outcome: VerifyOutcome, draft_s: float, drafter_commit_s: float
    ) -> None:
        super()._record(sequence, proposal, outcome, draft_s, drafter_commit_s)
        self.rounds.append(RoundRecord(len(proposal.tree), outcome.verdict.num_accepted, draft_s, outcome.verify_s))


@dataclass
class Tally:
    """Totals of one configuration over requests, split into drafted and undrafted rounds."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    drafted_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i]: drafted rounds that accepted at least i + 1
    draft_s: float = 0.0
    verify_s: float = 0.0
    drafted_verify_s: float = 0.0
    state_s: float = 0.0

    def add(self, result: GenerationResult, rounds: Sequence[RoundRecord]) -> None:
        self.requests += 1
        self.tokens += len(result.token_ids)
        self.seconds += result.elapsed_s
        self.state_s += result.stats.state_s
        for record in rounds:
            self.rounds += 1
            self.draft_s += record.draft_s
            self.verify_s += record.verify_s
            if not record.drafted:
                continue
            self.drafted_rounds += 1
            self.draft_tokens += record.drafted
            self.accepted_tokens += record.accepted
            self.drafted_verify_s += record.verify_s
            self.accepted_at.extend([0] * (record.accepted - len(self.accepted_at)))
            for position in range(record.accepted):
                self.accepted_at[position] += 1

    def summary(self, depth: int) -> dict[str, Any]:
        """Raw totals plus the derived rates of :data:`DEFINITIONS`; ``acc`` holds acc@1..``depth``."""
        drafted = self.drafted_rounds
        forward_ms = 1000 * self.drafted_verify_s / drafted if drafted else None
        draft_ms = 1000 * self.draft_s / self.draft_tokens if self.draft_tokens else None
        counts = self.accepted_at + [0] * (depth - len(self.accepted_at))
        return {
            **asdict(self),
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "acc": [count / drafted for count in counts[:depth]] if drafted else None,
            "mean_accepted_length": 1 + self.accepted_tokens / drafted if drafted else None,
            "tokens_per_round": 1 + self.accepted_tokens / self.rounds if self.rounds else None,
            "draft_ms_per_token": draft_ms,
            "target_forward_ms": forward_ms,
            "draft_to_forward": draft_ms / forward_ms if draft_ms is not None and forward_ms else None,
            "verify_ms_per_round_all": 1000 * self.verify_s / self.rounds if self.rounds else None,
            "tokens_per_s": self.tokens / self.seconds if self.seconds else None,
        }


def prompt_seed(token_ids: list[int]) -> int:
    """A sampled request's seed, from its prompt alone: every configuration starts from the same seed."""
    return zlib.crc32(json.dumps(token_ids).encode())


def recording_engine(target: LoadedModel, drafter: Drafter | None) -> RecordingEngine:
    return RecordingEngine(KVRunner(target.model), target.eos_token_ids, drafter)


def timed_engine(target: LoadedModel, drafter: Drafter | None, pack_weights: bool | None = None) -> Engine:
    """A plain engine (no per-round records) for the sections that time configurations against each other."""
    return Engine(KVRunner(target.model, pack_weights=pack_weights), target.eos_token_ids, drafter)


def eagle_drafters(
    target: LoadedModel,
    draft_model: str | None,
    shapes: Sequence[str] = tuple(SHAPES),
    quantization: str = "none",
    lookup_min_match: int | None = 0,
) -> dict[str, EagleDrafter]:
    """One drafter per named :data:`SHAPES` entry, all over one head (``build_drafter`` finds and checks it), its
    draft layers ``quantization``; prompt lookup from ``lookup_min_match`` (0, the default here: the head alone;
    None: the tail distill chose for the head, as served)."""
    first_name, *rest = shapes
    first = cast(
        EagleDrafter,
        build_drafter(
            "eagle",
            target,
            SHAPES[first_name],
            draft_model=draft_model,
            draft_quantization=quantization,
            lookup_min_match=lookup_min_match,
        ),
    )
    return {
        first_name: first,
        **{name: EagleDrafter(first.head, SHAPES[name], lookup_min_match=first.lookup_min_match) for name in rest},
    }


Config = tuple[RecordingEngine, SamplingParams]
Key = TypeVar("Key", bound=Hashable)


def measure(
    configs: dict[Key, Config], prompts: Sequence[Prompt], max_tokens: int, label: str
) -> dict[Key, dict[str, Tally]]:
    """Each prompt alone (batch 1) through every configuration, interleaved prompt by prompt so drifting machine
    load hits all alike, after one short uncounted warm-up each; per configuration, :class:`Tally` totals over
    all prompts (``"all"``) and per category."""
    for engine, params in configs.values():
        engine.generate([GenerationRequest(prompts[0].token_ids[:8], params, 8, seed=0)])
    tallies: dict[Key, dict[str, Tally]] = {name: {"all": Tally()} for name in configs}
    for index, prompt in enumerate(prompts):
        for name, (engine, params) in configs.items():
            engine.rounds.clear()
            request = GenerationRequest(prompt.token_ids, params, max_tokens, seed=prompt_seed(prompt.token_ids))
            [result] = engine.generate([request])
            for key in ("all", prompt.category):
                tallies[name].setdefault(key, Tally()).add(result, engine.rounds)
        _progress(f"{label}: prompt {index + 1}/{len(prompts)}")
    return tallies


def _measured_row(tallies: dict[str, Tally], depth: int) -> dict[str, Any]:
    """The totals' summary, with each category's mean accepted length and acceptance rate."""
    row = tallies["all"].summary(depth)
    row["by_category"] = {}
    for category, tally in sorted(tallies.items()):
        if category != "all":
            summary = tally.summary(depth)
            row["by_category"][category] = {key: summary[key] for key in ("mean_accepted_length", "acceptance_rate")}
    return row


def acceptance_section(target: LoadedModel, prompts: Sequence[Prompt], settings: Settings) -> list[dict[str, Any]]:
    """Every sampling × every shape of the head on the prompts."""
    drafters = eagle_drafters(target, settings.draft_model)
    engines = {shape: recording_engine(target, drafter) for shape, drafter in drafters.items()}
    configs = {
        (sampling, shape): (engines[shape], params) for sampling, params in SAMPLINGS.items() for shape in SHAPES
    }
    tallies = measure(configs, prompts, settings.max_tokens, "acceptance")
    return [
        {
            "sampling": sampling,
            "shape": shape,
            **_measured_row(tallies[sampling, shape], SHAPES[shape].num_draft_tokens),
        }
        for sampling, shape in configs
    ]


def agreement_section(target: LoadedModel, prompts: Sequence[Prompt], settings: Settings) -> list[dict[str, Any]]:
    """The head's teacher-forced agreement as served (:mod:`bench.eagle_agreement`) beside what training reported."""
    drafter = build_drafter(
        "eagle",
        target,
        SHAPES[BUDGET_SHAPE],
        draft_model=settings.draft_model,
        draft_quantization="none",
        lookup_min_match=0,
    )
    tally = teacher_forced_agreement(
        target, cast(EagleDrafter, drafter), [p.token_ids for p in prompts], settings.max_tokens
    )
    trained = head_summary(head_directory(target.name, settings.draft_model)).get("held_out_agreement") or [None]
    return [{**tally.row(), "trained_held_out_agreement": trained[0]}]


def sampled_generator(engine: Engine, params: SamplingParams, max_tokens: int) -> Generate:
    """Like :func:`bench.colocated.engine_generator`, under ``params`` with the prompt's seed."""

    def generate(prompt: list[int]) -> tuple[list[int], float, SpecStats | None]:
        [result] = engine.generate([GenerationRequest(prompt, params, max_tokens, seed=prompt_seed(prompt))])
        return result.token_ids, result.elapsed_s, result.stats

    return generate


def _speed_rows(results: list[ConfigResult], sampling: str) -> list[dict[str, Any]]:
    """Rows of one interleaved comparison; the first result is the target-only baseline."""
    baseline = results[0]
    rows = []
    for result in results:
        row = {key: value for key, value in asdict(result).items() if key != "outputs"}
        same = sum(a == b for a, b in zip(result.outputs, baseline.outputs, strict=True))
        row.update(
            sampling=sampling,
            tokens_per_s=result.tokens_per_s,
            speedup=result.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else None,
            tokens_per_round=result.mean_accepted_length,
            acceptance_rate=result.acceptance_rate,
            draft_ms_per_token=1e3 * result.draft_s / result.draft_tokens if result.draft_tokens else None,
            verify_ms_per_round=1e3 * result.verify_s / result.rounds if result.rounds else None,
            same_as_target_only=same if sampling == "greedy" else None,
            requests=len(result.outputs),
        )
        rows.append(row)
    return rows


def speed_section(target: LoadedModel, prompts: Sequence[Prompt], settings: Settings) -> list[dict[str, Any]]:
    """Greedy: target-only (also over torch's own matrix multiplies: the runner packs float32 CPU weights for oneDNN,
    :mod:`specdec.linear`), ngram, HF prompt lookup, every eagle shape, γ=4 with a bfloat16 head and the
    :data:`INT8_SHAPES` with an int8 one; then target-only vs eagle γ=4 (float32 and int8 head) at T=0.7."""
    max_tokens = settings.max_tokens
    drafters = eagle_drafters(target, settings.draft_model)

    def engine(drafter: Drafter | None, pack_weights: bool | None = None) -> Engine:
        return timed_engine(target, drafter, pack_weights)

    ngram = build_drafter("ngram", target, DraftConfig(num_draft_tokens=4))
    bfloat16_head = build_drafter(
        "eagle",
        target,
        SHAPES[BUDGET_SHAPE],
        draft_model=settings.draft_model,
        head_dtype=torch.bfloat16,
        draft_quantization="none",
        lookup_min_match=0,
    )
    int8 = eagle_drafters(target, settings.draft_model, INT8_SHAPES, quantization="int8")
    lookup = eagle_drafters(target, settings.draft_model, LOOKUP_SHAPES, quantization="int8", lookup_min_match=None)
    greedy: dict[str, Generate] = {
        "target-only": engine_generator(engine(None), max_tokens),
        "target-only, torch's own matmuls": engine_generator(engine(None, pack_weights=False), max_tokens),
        "ngram γ=4": engine_generator(engine(ngram), max_tokens),
        "hf-prompt-lookup γ=4": hf_generator(target, max_tokens, prompt_lookup_num_tokens=4),
        **{f"eagle {shape}": engine_generator(engine(drafter), max_tokens) for shape, drafter in drafters.items()},
        f"eagle {BUDGET_SHAPE}, bfloat16 head": engine_generator(engine(bfloat16_head), max_tokens),
        **{
            f"eagle {shape}, int8 head": engine_generator(engine(drafter), max_tokens)
            for shape, drafter in int8.items()
        },
        **{
            f"eagle {shape}, int8 head + prompt lookup": engine_generator(engine(drafter), max_tokens)
            for shape, drafter in lookup.items()
        },
    }
    token_ids = [prompt.token_ids for prompt in prompts]
    rows = _speed_rows(compare(greedy, token_ids), "greedy")
    _progress("speed greedy done")
    sampled = {
        "target-only": sampled_generator(engine(None), SAMPLED, max_tokens),
        f"eagle {BUDGET_SHAPE}": sampled_generator(engine(drafters[BUDGET_SHAPE]), SAMPLED, max_tokens),
        f"eagle {BUDGET_SHAPE}, int8 head": sampled_generator(engine(int8[BUDGET_SHAPE]), SAMPLED, max_tokens),
        f"eagle {BUDGET_SHAPE}, int8 head + prompt lookup": sampled_generator(
            engine(lookup[BUDGET_SHAPE]), SAMPLED, max_tokens
        ),
    }
    return rows + _speed_rows(compare(sampled, token_ids), "T=0.7")


def trees_section(target: LoadedModel, prompts: Sequence[Prompt], settings: Settings) -> list[dict[str, Any]]:
    """Greedy, the head as served (int8 draft layers, prompt lookup): the :data:`TREE_SHAPES` chains and dynamic
    trees, each tree beside the chain that verifies as many positions, and target-only."""
    drafters = eagle_drafters(target, settings.draft_model, TREE_SHAPES, quantization="int8", lookup_min_match=None)

    def generator(drafter: Drafter | None) -> Generate:
        return engine_generator(timed_engine(target, drafter), settings.max_tokens)

    configs = {"target-only": generator(None), **{f"eagle {shape}": generator(d) for shape, d in drafters.items()}}
    return _speed_rows(compare(configs, [prompt.token_ids for prompt in prompts]), "greedy")


def head_directory(target: str, draft_model: str | None) -> Path:
    """The head's directory: ``draft_model``, or the head cached for ``target``."""
    return Path(draft_model).expanduser() if draft_model else default_head_dir(target)


def head_summary(directory: Path) -> dict[str, Any]:
    """The head's ``train-summary.json`` (written by ``specdec distill``), or ``{}`` when it has none."""
    path = directory / SUMMARY_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def budgets_section(target: LoadedModel, prompts: Sequence[Prompt], settings: Settings) -> list[dict[str, Any]]:
    """Each budget head at γ = 4, greedy, with what its training cost."""
    depth = SHAPES[BUDGET_SHAPE].num_draft_tokens
    rows = []
    for directory in settings.budget_heads:
        drafter = build_drafter(
            "eagle",
            target,
            SHAPES[BUDGET_SHAPE],
            draft_model=str(directory),
            draft_quantization="none",
            lookup_min_match=0,
        )
        configs = {BUDGET_SHAPE: (recording_engine(target, drafter), GREEDY)}
        tallies = measure(configs, prompts, settings.max_tokens, f"budget head {directory}")[BUDGET_SHAPE]
        summary = head_summary(directory)
        training = {key: summary.get(key) for key in TRAINING_KEYS}
        rows.append({"head": str(directory), **training, **_measured_row(tallies, depth)})
    return rows


def lookup_section(target: LoadedModel, prompts: Sequence[Prompt], settings: Settings) -> list[dict[str, Any]]:
    """Target-only, the ngram drafter and the int8 head at γ = 4 with each of the settings' lookup tail matches,
    greedy and T = 0.7, with tokens per round and speed by category."""
    engines: dict[str, RecordingEngine] = {
        "target-only": recording_engine(target, None),
        "ngram": recording_engine(target, build_drafter("ngram", target, SHAPES[BUDGET_SHAPE])),
    }
    for min_match in settings.lookup_min_matches:
        [drafter] = eagle_drafters(
            target, settings.draft_model, [BUDGET_SHAPE], quantization="int8", lookup_min_match=min_match
        ).values()
        engines[f"lookup ≥ {min_match}" if min_match else "head alone"] = recording_engine(target, drafter)
    configs = {
        (sampling, name): (engine, params) for sampling, params in SAMPLINGS.items() for name, engine in engines.items()
    }
    tallies = measure(configs, prompts, settings.max_tokens, "lookup")
    rows = []
    for (sampling, name), by_category in tallies.items():
        baseline = tallies[sampling, "target-only"]
        depth = SHAPES[BUDGET_SHAPE].num_draft_tokens
        summary = {key: tally.summary(depth) for key, tally in by_category.items()}
        speed = {
            key: row["tokens_per_s"] / baseline[key].summary(depth)["tokens_per_s"] for key, row in summary.items()
        }
        rows.append(
            {
                "sampling": sampling,
                "config": name,
                **summary["all"],
                "speedup": speed["all"],
                "by_category": {
                    key: {"tokens_per_round": summary[key]["tokens_per_round"], "speedup": speed[key]}
                    for key in sorted(by_category)
                    if key != "all"
                },
            }
        )
    return rows


SectionRun = Callable[[LoadedModel, Sequence[Prompt], Settings], list[dict[str, Any]]]
SECTION_RUNS: dict[str, SectionRun] = {
    "acceptance": acceptance_section,
    "agreement": agreement_section,
    "speed": speed_section,
    "trees": trees_section,
    "lookup": lookup_section,
    "budgets": budgets_section,
}


def run_sections(
    target: LoadedModel,
    prompts: Sequence[Prompt],
    sections: Sequence[str],
    settings: Settings,
    meta: dict[str, Any],
    output: Path,
) -> dict[str, Any]:
    """Run ``sections`` in :data:`SECTIONS` order; ``output``.json/.md are rewritten after each one."""
    payload: dict[str, Any] = {"meta": meta, "definitions": DEFINITIONS}
    for name in (section for section in SECTIONS if section in sections):
        started = time.perf_counter()
        rows = SECTION_RUNS[name](target, prompts, settings)
        payload[name] = {"wall_s": round(time.perf_counter() - started, 1), "load_after": _load(), "rows": rows}
        output.parent.mkdir(parents=True, exist_ok=True)
        output.with_suffix(".json").write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
        output.with_suffix(".md").write_text(markdown(payload))
    return payload


def heldout_conversations(count: int | None) -> list[dict]:
    """The first ``count`` held-out rows of the prompt set, categories in turn; long prompts are measured apart
    (:mod:`bench.eagle_context`), so results stay comparable with those before they existed."""
    records = [asdict(record) for record in load_prompt_set("heldout") if record.category != LONG_CONTEXT]
    return [row for _, row in interleave_categories(records, count)]


def heldout_prompts(target: LoadedModel, count: int | None) -> list[Prompt]:
    """:func:`heldout_conversations` through the chat template."""
    if target.tokenizer is None:
        raise InvalidArgumentError("target", f"{target.name!r} has no tokenizer to apply the chat template")
    rows = heldout_conversations(count)
    return [Prompt(row["id"], row["category"], encode_chat(target.tokenizer, row["messages"])) for row in rows]


def describe(
    target: str, draft_model: str | None, prompts: Sequence[Prompt], max_tokens: int, command: str
) -> dict[str, Any]:
    """The run's labels: hardware, versions, command, head and prompt set."""
    head = head_directory(target, draft_model)
    lengths = [len(prompt.token_ids) for prompt in prompts]
    return {
        "target": target,
        "head": str(head),
        "head_training": head_summary(head),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_before": _load(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": "float32",
        "batch_size": 1,
        "max_tokens": max_tokens,
        "draft_top_k": DraftConfig().draft_top_k,
        "num_prompts": len(prompts),
        "categories": sorted({prompt.category for prompt in prompts}),
        "prompt_tokens": {"mean": sum(lengths) / len(lengths), "min": min(lengths), "max": max(lengths)},
    }


# --- report ---------------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _acc_cells(row: dict[str, Any], depth: int) -> list[str]:
    acc = row["acc"] or []
    return [_fmt(acc[i], ".3f") if i < len(acc) else "" for i in range(depth)]


def _acceptance_table(rows: list[dict[str, Any]]) -> list[str]:
    acc_heads = " | ".join(f"acc@{i}" for i in range(1, MAX_DEPTH + 1))
    lines = [
        f"| sampling | shape | acceptance rate | {acc_heads} | τ (drafted rounds) | tokens/round (all rounds) "
        "| draft ms/token | target fwd ms | c | tokens/s |",
        "|---|---|---" + "|---" * MAX_DEPTH + "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            row["sampling"],
            row["shape"],
            _fmt(row["acceptance_rate"], ".3f"),
            *_acc_cells(row, MAX_DEPTH),
            _fmt(row["mean_accepted_length"]),
            _fmt(row["tokens_per_round"]),
            _fmt(row["draft_ms_per_token"]),
            _fmt(row["target_forward_ms"], ".1f"),
            _fmt(row["draft_to_forward"], ".3f"),
            _fmt(row["tokens_per_s"], ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _agreement_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| positions | agreement as served | after an agreed position | after a missed one | target token outside "
        "the draft vocabulary | training's held-out agreement (depth 1) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['positions']} | {_fmt(row['agreement'], '.3f')} | {_fmt(row['after_agreed'], '.3f')} "
            f"({row['after_agreed_positions']}) | {_fmt(row['after_missed'], '.3f')} ({row['after_missed_positions']}) "
            f"| {_fmt(row['outside_draft_vocab'], '.3f')} | {_fmt(row['trained_held_out_agreement'], '.3f')} |"
        )
    return lines


def _speed_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| sampling | config | tokens | tokens/s | × target-only | tokens/round (all rounds) | acceptance rate "
        "| draft ms / drafted token | verify ms / round | same tokens as target-only |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        same = "–" if row["same_as_target_only"] is None else f"{row['same_as_target_only']}/{row['requests']}"
        cells = [
            row["sampling"],
            row["name"],
            str(row["tokens"]),
            _fmt(row["tokens_per_s"], ".1f"),
            _fmt(row["speedup"]),
            _fmt(row["tokens_per_round"]),
            _fmt(row["acceptance_rate"], ".3f"),
            _fmt(row.get("draft_ms_per_token"), ".2f"),
            _fmt(row.get("verify_ms_per_round"), ".1f"),
            same,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _lookup_table(rows: list[dict[str, Any]]) -> list[str]:
    categories = sorted({category for row in rows for category in row["by_category"]})
    lines = [
        "tokens/round, then × target-only in tokens/s, overall and by category:",
        "",
        "| sampling | config | tokens/round | × target-only | "
        + " | ".join(f"{category} tok/round, ×" for category in categories)
        + " |",
        "|---|---|---|---" + "|---" * len(categories) + "|",
    ]
    for row in rows:
        cells = [row["sampling"], row["config"], _fmt(row["tokens_per_round"]), _fmt(row["speedup"])]
        for category in categories:
            entry = row["by_category"].get(category)
            cells.append(f"{_fmt(entry['tokens_per_round'])}, {_fmt(entry['speedup'])}" if entry else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _budget_table(rows: list[dict[str, Any]]) -> list[str]:
    depth = SHAPES[BUDGET_SHAPE].num_draft_tokens
    acc_heads = " | ".join(f"acc@{i}" for i in range(1, depth + 1))
    lines = [
        "| head | features | train minutes | training tokens | tokens seen | held-out τ (γ=4, drafted rounds) "
        f"| tokens/round (all rounds) | acceptance rate | {acc_heads} |",
        "|---|---|---|---|---|---|---|---" + "|---" * depth + "|",
    ]
    for row in rows:
        cells = [
            f"`{row['head']}`",
            row.get("features") or "final",
            "" if row["train_minutes"] is None else f"{row['train_minutes']:.1f}",
            "" if row["training_tokens"] is None else str(row["training_tokens"]),
            "" if row["tokens_seen"] is None else str(row["tokens_seen"]),
            _fmt(row["mean_accepted_length"]),
            _fmt(row["tokens_per_round"]),
            _fmt(row["acceptance_rate"], ".3f"),
            *_acc_cells(row, depth),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(payload: dict[str, Any]) -> str:
    """The report of the sections ``payload`` holds so far."""
    meta = payload["meta"]
    training = meta["head_training"]
    trained = (
        f"{training.get('train_minutes', '?')} training minutes, {training.get('training_tokens', '?')} training tokens"
        if training
        else "no train-summary.json"
    )
    lengths = meta["prompt_tokens"]
    lines = [
        f"# EAGLE drafting on `{meta['target']}` (co-located)",
        "",
        f"{meta['date']} · {meta['cpu']} ({meta['cpus']} CPUs, {meta['threads']} torch threads, load average "
        f"{meta['load_before']} before; the machine may be shared) · Python {meta['python']} · torch {meta['torch']} "
        f"· transformers {meta['transformers']}",
        "",
        f"`{meta['command']}`",
        "",
        f"Head `{meta['head']}` ({trained}). {meta['num_prompts']} held-out prompts "
        f"({', '.join(meta['categories'])}; {lengths['min']}–{lengths['max']} prompt tokens, mean "
        f"{lengths['mean']:.0f}), {meta['dtype']}, batch {meta['batch_size']}, at most {meta['max_tokens']} new "
        f"tokens, EOS honoured, draft top-k {meta['draft_top_k']}.",
    ]
    tables = {
        "acceptance": ("Acceptance (co-located, held-out prompts)", _acceptance_table),
        "agreement": ("Teacher-forced agreement as served (greedy answers, depth 1)", _agreement_table),
        "speed": ("Speed (greedy, batch 1, configurations interleaved prompt by prompt)", _speed_table),
        "trees": (
            "Chains and dynamic trees as served (int8 head + prompt lookup, greedy, batch 1, interleaved)",
            _speed_table,
        ),
        "lookup": ("Prompt lookup in the eagle drafter (int8 head, γ = 4, batch 1, interleaved)", _lookup_table),
        "budgets": ("Training budget → held-out mean accepted length (γ = 4, greedy)", _budget_table),
    }
    for name in SECTIONS:
        if name in payload:
            title, table = tables[name]
            section = payload[name]
            timing = f"{section['wall_s']:.0f} s, load average {section['load_after']} after."
            lines += ["", f"## {title}", "", timing, ""]
            lines += table(section["rows"])
    lines += ["", "## Definitions", "", DEFINITIONS]
    return "\n".join(lines)


def _load() -> str:
    return "/".join(f"{value:.2f}" for value in os.getloadavg())


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft-model", help="EAGLE head directory (default: the head cached for --target)")
    parser.add_argument("--num-prompts", type=int, default=24, help="held-out prompts, categories in turn")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--sections", help=f"comma-separated, of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--budget-heads", default="", help="comma-separated head directories (budgets section)")
    parser.add_argument(
        "--lookup-min-matches",
        type=comma_ints,
        default=list(LOOKUP_MIN_MATCHES),
        help="lookup section: the tail matches that make a round a lookup chain (0: the head alone)",
    )
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    sections = args.sections.split(",") if args.sections else list(SECTIONS)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    budget_heads = tuple(Path(d).expanduser() for d in args.budget_heads.split(",") if d.strip())
    if "budgets" in sections and not budget_heads:
        if args.sections:
            parser.error("the budgets section needs --budget-heads DIR1,DIR2,...")
        sections.remove("budgets")

    torch.set_num_threads(args.threads)
    quiet_model_loading()
    target = load_model(args.target)
    prompts = heldout_prompts(target, args.num_prompts)
    command = shlex.join(["python", "-m", "bench.eagle", *argv])
    meta = describe(args.target, args.draft_model, prompts, args.max_tokens, command)
    settings = Settings(args.max_tokens, args.draft_model, budget_heads, tuple(args.lookup_min_matches))
    stem = "eagle" if not args.sections else "-".join(["eagle", *sections])
    payload = run_sections(target, prompts, sections, settings, meta, args.output_dir / stem)
    print(markdown(payload))


if __name__ == "__main__":
    main()
