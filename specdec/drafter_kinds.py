"""The names of the drafter kinds, apart from the drafters themselves so that a command line can offer them
without importing torch."""

from __future__ import annotations

from typing import Literal

DrafterKind = Literal["none", "ngram", "model", "early-exit", "eagle"]
DRAFTER_KINDS: tuple[str, ...] = ("none", "ngram", "model", "early-exit", "eagle")
SHAPE_ONLY_KINDS: tuple[str, ...] = ("none", "ngram", "eagle")  # run none of the target's weights
