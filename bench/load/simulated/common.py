"""What the simulated verifier and drafter share: the token tree's indexing and the sequence-table errors.

The errors are the real services' (an empty id is INVALID_ARGUMENT, an unknown one NOT_FOUND through a
``KeyError``), so the router sees the same status codes from a simulated worker as from a real one.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.errors import InvalidArgumentError

ROOT = -1  # the parent index of a tree's first-level nodes, as on the wire


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Node index → its children in order; ROOT (-1) holds the first level."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def check_sequence_id(sequence_id: str) -> None:
    if not sequence_id:
        raise InvalidArgumentError("sequence_id", "must not be empty")


def not_open(sequence_id: str) -> KeyError:
    return KeyError(f"sequence_id: no open sequence {sequence_id!r}")
