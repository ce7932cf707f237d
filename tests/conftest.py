"""Test-wide settings."""

from collections import Counter

import pytest
import torch

# The tests drive tiny models where intra-op threading costs more than it saves (10x on two cores).
torch.set_num_threads(1)

# `make test` runs files on two xdist workers (--dist loadfile), each file in the order below. These two bring up a
# whole Ray deployment of the real model (about 4 and 2.5 minutes): started last, as xdist's default order (most
# tests first) does, one of them ran alone at the end while the other worker idled.
FIRST_FILES = ("test_launcher.py", "test_k8s.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the files: :data:`FIRST_FILES`, then those with a ``slow`` test, then the rest, each group by test
    count, most first (xdist's own order, which ``--no-loadscope-reorder`` turns off so that this one holds); a
    file's tests keep their order."""
    counts = Counter(item.path for item in items)
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[int, bool, int, str]:
        name = item.path.name
        first = FIRST_FILES.index(name) if name in FIRST_FILES else len(FIRST_FILES)
        return first, item.path not in slow, -counts[item.path], str(item.path)

    items.sort(key=rank)
