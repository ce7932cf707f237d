"""What the load generator sends: prompts from a JSONL file and the options every request shares.

A prompt line is ``{"id": str, "category": str, "prompt": str}``; ``id`` may be missing (older files such as
``bench/prompts/colocated.jsonl``), then it is ``STEM-LINE``. Requests take prompts from a seeded shuffle of the
file, cycling when there are more requests than prompts, so a short run still mixes categories and two runs with
the same seed send the same prompts in the same order. Each request's sampling seed is ``seed + index``: the
same request gets the same seed whatever the load, so off vs on at one seed compares like with like.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

SpeculationMode = Literal["off", "sequential", "pipelined", "auto"]
MODES: tuple[str, ...] = ("off", "sequential", "pipelined", "auto")


@dataclass(frozen=True)
class Prompt:
    """One prompt of the workload."""

    id: str
    category: str
    text: str


def load_prompts(path: Path, categories: Sequence[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """The prompts of ``path`` (file order), only ``categories`` if given, at most ``limit``."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        text = row.get("prompt", row.get("text"))
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}:{number}: needs a non-empty string 'prompt'")
        prompt = Prompt(str(row.get("id", f"{Path(path).stem}-{number}")), row.get("category", "uncategorised"), text)
        if categories is None or prompt.category in categories:
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path}: no prompts" + (f" in categories {list(categories)}" if categories else ""))
    return prompts[:limit] if limit is not None else prompts


class PromptCycle:
    """Request ``index``'s prompt: a seeded shuffle of the prompts, repeated as often as needed."""

    def __init__(self, prompts: Sequence[Prompt], seed: int) -> None:
        self.prompts = list(prompts)
        self.order = np.random.default_rng(seed).permutation(len(self.prompts))

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[int(self.order[index % len(self.prompts)])]


@dataclass(frozen=True)
class RequestOptions:
    """Sampling and speculation options of every request; None leaves the router's default."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = 0  # base seed: request i is sent with seed + i
    ignore_eos: bool = False
    speculation: SpeculationMode | None = None
    drafter: str | None = None
    num_draft_tokens: int | None = None
    tree_width: int | None = None
    tree_budget: int | None = None
    chat: bool = True

    def for_request(self, index: int) -> RequestOptions:
        """These options with request ``index``'s own seed."""
        return self if self.seed is None else replace(self, seed=self.seed + index)

    def wire_options(self) -> dict[str, object]:
        """The options set explicitly, by their API names (the same in the SDK and the HTTP extensions)."""
        options: dict[str, object] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
        }
        optional = {
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "speculation": self.speculation,
            "drafter": self.drafter,
            "num_draft_tokens": self.num_draft_tokens,
            "tree_width": self.tree_width,
            "tree_budget": self.tree_budget,
        }
        options.update({key: value for key, value in optional.items() if value is not None})
        return options
