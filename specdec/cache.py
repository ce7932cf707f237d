"""Where trained draft heads and their training data live: ``SPECDEC_CACHE`` (default ``~/.cache/specdec``).

Nothing here enters git; every file under the cache is rebuilt by ``specdec distill``. Names are derived from
the target's name so that one cache serves several targets: ``eagle/<target>/`` holds the head that
``--drafter eagle`` uses when no ``--draft-model`` is named, ``distill-data/<target>/`` its training shards,
``models/<file>-<key>/`` the float32 copy of a GGUF model that loads instead of the file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
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


def gguf_copy_dir(gguf: Path) -> Path:
    """Where the float32 safetensors copy of the model in the file ``gguf`` lives. The key covers the file's path,
    size and modification time and the ``transformers`` version that dequantises it, so a changed file or converter
    gets a copy of its own."""
    stat = gguf.stat()
    source = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{importlib.metadata.version('transformers')}"
    return cache_dir() / "models" / f"{_slug(gguf.stem)}-{hashlib.sha256(source.encode()).hexdigest()[:16]}"
