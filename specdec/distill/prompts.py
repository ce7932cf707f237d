"""The prompt set for self-distilling an EAGLE draft head from the target model (SmolLM2-135M-Instruct).

``prompts.jsonl`` holds about 4800 chat conversations written for this project, 550 in each of eight categories (chat,
code, maths, lists, rewrite, summarise, qa, multi-turn) and 430 ``long-context`` ones: a document of many parts (a
report, source files) of 650-2 000 tokens with a task about it, or a conversation that goes on after one, so a head
also learns the target's features far into a text (a head trained on short prompts alone agreed with the target on
0.52 of short held-out answers, 0.32 when a long document came first; ``bench/results/eagle-long-context.md``). Each
row's last message is a user turn: the target model answers it, and the draft head is trained on those answers. A
``heldout`` split of 30 rows per category measures the trained head's acceptance rate on prompts it was not trained
on; no held-out user text equals a training one, and no row equals or reuses a sentence of the benchmark prompts in
``bench/prompts/``.

The file is generated, never edited by hand: ``python -m specdec.distill.make_prompts`` rewrites it byte-identically.
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from specdec.errors import InvalidArgumentError

PROMPT_SET_PATH = Path(__file__).with_name("prompts.jsonl")
SPLITS = ("train", "heldout")
LONG_CONTEXT = "long-context"  # the category of long prompts (benchmarks of short prompts leave it out)
CATEGORIES = ("chat", "code", "maths", "lists", "rewrite", "summarise", "qa", "multi-turn", LONG_CONTEXT)

Row = TypeVar("Row")


@dataclass(frozen=True)
class PromptRecord:
    id: str
    category: str
    split: str
    messages: tuple[dict[str, str], ...]


def load_prompt_set(split: str | None = None, path: Path | None = None) -> list[PromptRecord]:
    """Rows of the prompt set in file order; ``split`` keeps only ``"train"`` or ``"heldout"`` rows (None: all)."""
    if split is not None and split not in SPLITS:
        raise InvalidArgumentError("split", f"unknown split {split!r}; expected one of {', '.join(SPLITS)} or None")
    records = []
    with (path or PROMPT_SET_PATH).open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if split is None or row["split"] == split:
                records.append(
                    PromptRecord(
                        id=row["id"],
                        category=row["category"],
                        split=row["split"],
                        messages=tuple(dict(m) for m in row["messages"]),
                    )
                )
    return records


def interleave_categories(
    rows: Sequence[Row], count: int | None, category: Callable[[Row], str] = lambda row: row["category"]
) -> list[tuple[int, Row]]:
    """The first ``count`` rows (None: all) taking categories in turn, so a short selection still spans them, each
    with its index in ``rows``; within a category, file order. ``category``: a row's category (default: a dict's)."""
    by_category: dict[str, list[tuple[int, Any]]] = {}
    for index, row in enumerate(rows):
        by_category.setdefault(category(row), []).append((index, row))
    lanes = list(by_category.values())
    chosen: list[tuple[int, Row]] = []
    for depth in range(max((len(lane) for lane in lanes), default=0)):
        chosen.extend(lane[depth] for lane in lanes if depth < len(lane))
    return chosen[:count] if count is not None else chosen
