"""Where trained draft heads and their training data live: ``SPECDEC_CACHE`` (default ``~/.cache/specdec``).

Nothing here enters git; every file under the cache is rebuilt by ``specdec distill``. Names are derived from
the target's name so that one cache serves several targets: ``eagle/<target>/`` holds the head that
``--drafter eagle`` uses when no ``--draft-model`` is named, ``distill-data/<target>/`` its training shards.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec").expanduser()


def _slug(target: str) -> str:
    """A directory name for a target name: ``smollm2-135m`` stays, ``org/model`` becomes ``org--model``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "--", target.strip("/")) or "target"


def default_head_dir(target: str) -> Path:
    """The cached EAGLE head trained for ``target`` (``specdec distill --target TARGET`` writes it)."""
    return cache_dir() / "eagle" / _slug(target)


def distill_data_dir(target: str) -> Path:
    """Self-distillation shards of ``target`` (responses and features)."""
    return cache_dir() / "distill-data" / _slug(target)
