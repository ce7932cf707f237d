"""Draft distributions and target feature rows <-> their packed wire form (tensors; the workers' side).

A drafter truncates its own distribution (its top-k), so ``q`` has small support; rows are sent
as packed little-endian int32 ids and float32 probabilities, bit-exact, and expanded back into a
dense row with exact zeros outside the support (DESIGN §5). Siblings that were drawn from one
distribution share one row on the wire.

The target's feature rows (what an EAGLE drafter drafts from) travel as one ``FeatureRows`` block: ``width``
values per row, packed little-endian row-major in float16 (the default), bfloat16 or float32; the row count
follows from the byte length. They are cast with torch's rounding on the way out and widened exactly to
float32 on the way in.
"""

from __future__ import annotations

import numpy as np
import torch
from specdec_wire.v1 import common_pb2

from grpc_common.convert import MAX_PROPOSAL_NODES, tree_from_wire, tree_to_wire
from specdec.drafters.base import Proposal
from specdec.errors import InvalidArgumentError

MAX_FEATURE_ROWS = 1 << 17  # positions in one FeatureRows: more than any context served here


_SCHEME_TO_WIRE = {
    "iid": common_pb2.SIBLING_SAMPLING_IID,
    "without_replacement": common_pb2.SIBLING_SAMPLING_WITHOUT_REPLACEMENT,
}
_SCHEME_FROM_WIRE = {
    common_pb2.SIBLING_SAMPLING_UNSPECIFIED: "iid",
    common_pb2.SIBLING_SAMPLING_IID: "iid",
    common_pb2.SIBLING_SAMPLING_WITHOUT_REPLACEMENT: "without_replacement",
}


_FEATURE_DTYPE_TO_WIRE = {
    torch.float16: common_pb2.FEATURE_DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.FEATURE_DTYPE_BFLOAT16,
    torch.float32: common_pb2.FEATURE_DTYPE_FLOAT32,
}
_FEATURE_DTYPE_FROM_WIRE = {
    common_pb2.FEATURE_DTYPE_UNSPECIFIED: torch.float16,
    **{wire: dtype for dtype, wire in _FEATURE_DTYPE_TO_WIRE.items()},
}
_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32}  # the bits of a value, as an integer of its size


def proposal_to_wire(proposal: Proposal) -> common_pb2.Proposal:
    """Encode ``proposal``; rows shared by siblings (the same tensor object or equal values) are sent once."""
    message = common_pb2.Proposal(tree=tree_to_wire(proposal.tree), sibling_sampling=_SCHEME_TO_WIRE[proposal.scheme])
    if proposal.draft_probs is None:
        return message
    draft = message.draft
    row_of_parent: dict[int, int] = {}
    for node, parent in enumerate(proposal.tree.parents):
        if parent not in row_of_parent:
            row_of_parent[parent] = len(draft.rows)
            draft.rows.append(_sparse_row(proposal.draft_probs[node]))
        draft.node_rows.append(row_of_parent[parent])
    return message


def proposal_from_wire(
    message: common_pb2.Proposal, vocab_size: int, *, max_nodes: int = MAX_PROPOSAL_NODES
) -> Proposal:
    """Decode into dense ``draft_probs`` [N, V] (exact zeros outside each row's support).

    Checked before anything is allocated, each failure an InvalidArgumentError naming the field: at most ``max_nodes``
    nodes, a parent per node, a known sibling scheme; at most one draft row per node, each of at most ``vocab_size``
    distinct ids in [0, vocab_size) with one float32 probability each, and one existing row per node.
    """
    tree = message.tree
    if len(tree.tokens) > max_nodes:
        raise InvalidArgumentError("proposal.tree.tokens", f"{len(tree.tokens)} nodes; at most {max_nodes}")
    if len(tree.parents) != len(tree.tokens):
        raise InvalidArgumentError("proposal.tree.parents", "needs one parent per node")
    scheme = _SCHEME_FROM_WIRE.get(message.sibling_sampling)
    if scheme is None:
        raise InvalidArgumentError("proposal.sibling_sampling", f"unknown value {message.sibling_sampling}")
    try:
        decoded = tree_from_wire(tree)
    except ValueError as error:
        raise InvalidArgumentError("proposal.tree", str(error)) from None
    if not message.HasField("draft"):
        return Proposal(decoded, None, scheme)
    draft = message.draft
    if len(draft.rows) > max(len(decoded), 1):
        raise InvalidArgumentError("proposal.draft.rows", f"{len(draft.rows)} rows for {len(decoded)} nodes")
    if len(draft.node_rows) != len(decoded) or any(not 0 <= row < len(draft.rows) for row in draft.node_rows):
        raise InvalidArgumentError("proposal.draft.node_rows", "must name one existing row per tree node")
    sparse = [_sparse_from_wire(index, row, vocab_size) for index, row in enumerate(draft.rows)]
    if not len(decoded):
        return Proposal(decoded, None, scheme)
    # scattered straight into the [N, V] rows the core takes: one dense allocation, no [rows, V] copy to gather
    # from (``python -m bench.wire``: ~250 -> ~140 µs for a chain of 4 over a 49152 vocabulary)
    node_rows = list(draft.node_rows)
    ids = torch.cat([sparse[row][0] for row in node_rows])
    probs = torch.cat([sparse[row][1] for row in node_rows])
    sizes = torch.tensor([len(sparse[row][0]) for row in node_rows])
    dense = torch.zeros(len(decoded), vocab_size, dtype=torch.float32)
    dense[torch.repeat_interleave(torch.arange(len(decoded)), sizes), ids] = probs
    return Proposal(decoded, dense, scheme)


def _sparse_from_wire(index: int, row: common_pb2.SparseRow, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, probs)`` of one draft row, checked (sizes first, so nothing big is decoded from a bad row)."""
    field = f"proposal.draft.rows[{index}]"
    if len(row.ids) % 4 or len(row.probs) != len(row.ids):
        raise InvalidArgumentError(field, "ids and probs must be packed 4-byte values, one probability per id")
    if len(row.ids) // 4 > vocab_size:
        raise InvalidArgumentError(field, f"{len(row.ids) // 4} ids; at most the vocabulary's {vocab_size}")
    ids = np.frombuffer(row.ids, dtype="<i4").astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidArgumentError(field, f"ids must lie in [0, {vocab_size})")
    if np.unique(ids).size != ids.size:
        raise InvalidArgumentError(field, "ids must be distinct")
    return torch.from_numpy(ids), torch.from_numpy(np.frombuffer(row.probs, dtype="<f4").copy())


def _sparse_row(row: torch.Tensor) -> common_pb2.SparseRow:
    ids = torch.nonzero(row > 0).flatten()
    return common_pb2.SparseRow(
        ids=ids.numpy().astype("<i4").tobytes(), probs=row[ids].float().numpy().astype("<f4").tobytes()
    )


def feature_dtype_from_wire(value: int) -> torch.dtype:
    """The torch dtype of a ``FeatureDtype`` (unset: float16); raises InvalidArgumentError for unknown values."""
    dtype = _FEATURE_DTYPE_FROM_WIRE.get(value)
    if dtype is None:
        raise InvalidArgumentError("feature_dtype", f"unknown feature dtype {value}")
    return dtype


def features_to_wire(rows: torch.Tensor, start: int, dtype: torch.dtype) -> common_pb2.FeatureRows:
    """Encode ``rows`` [R, width] (any device and float dtype) of positions ``start ..`` in ``dtype``."""
    cast = rows.detach().to("cpu", dtype).contiguous()
    size = cast.element_size()
    data = cast.view(_SAME_SIZE_INT[size]).numpy().astype(f"<i{size}").tobytes()
    return common_pb2.FeatureRows(start=start, width=rows.shape[1], dtype=_FEATURE_DTYPE_TO_WIRE[dtype], data=data)


def features_from_wire(
    message: common_pb2.FeatureRows, *, width: int | None = None, max_rows: int = MAX_FEATURE_ROWS
) -> tuple[int, torch.Tensor]:
    """``(start, rows)``: the rows [R, width] as float32, exactly the values sent.

    Checked before anything is allocated: ``message.width`` positive (and equal to ``width`` when given), a known dtype,
    the byte length a whole number of rows, at most ``max_rows`` rows, ``start`` >= 0; else InvalidArgumentError
    naming ``features``.
    """
    if message.width <= 0:
        raise InvalidArgumentError("features", f"width must be > 0, got {message.width}")
    if width is not None and message.width != width:
        raise InvalidArgumentError("features", f"rows of width {message.width}, expected {width}")
    dtype = _FEATURE_DTYPE_FROM_WIRE.get(message.dtype)
    if dtype is None:
        raise InvalidArgumentError("features", f"unknown dtype {message.dtype}")
    if message.start < 0:
        raise InvalidArgumentError("features", f"start must be >= 0, got {message.start}")
    size = dtype.itemsize
    row_bytes = message.width * size
    if len(message.data) % row_bytes:
        raise InvalidArgumentError("features", f"{len(message.data)} bytes are not whole rows of {row_bytes} bytes")
    count = len(message.data) // row_bytes
    if count > max_rows:
        raise InvalidArgumentError("features", f"{count} rows; at most {max_rows} in one message")
    bits = np.frombuffer(message.data, dtype=f"<i{size}").astype(f"=i{size}")  # a native copy torch can own
    rows = torch.from_numpy(bits).view(dtype).float()
    return message.start, rows.view(count, message.width)
