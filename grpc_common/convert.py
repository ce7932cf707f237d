"""Proto messages <-> core types. Draft distributions travel exactly as sparse (ids, probs) rows.

A drafter truncates its own distribution (its top-k), so ``q`` has small support; rows are sent
as packed little-endian int32 ids and float32 probabilities, bit-exact, and expanded back into a
dense row with exact zeros outside the support (DESIGN §5). Siblings that were drawn from one
distribution share one row on the wire.
"""

from __future__ import annotations

import numpy as np
import torch
from specdec_wire.v1 import common_pb2

from specdec.drafters.base import Proposal
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

_SCHEME_TO_WIRE = {
    "iid": common_pb2.SIBLING_SAMPLING_IID,
    "without_replacement": common_pb2.SIBLING_SAMPLING_WITHOUT_REPLACEMENT,
}
_SCHEME_FROM_WIRE = {
    common_pb2.SIBLING_SAMPLING_UNSPECIFIED: "iid",
    common_pb2.SIBLING_SAMPLING_IID: "iid",
    common_pb2.SIBLING_SAMPLING_WITHOUT_REPLACEMENT: "without_replacement",
}


def sampling_to_wire(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p
    )


def sampling_from_wire(message: common_pb2.SamplingParams) -> SamplingParams:
    """Unset temperature and top_p mean 1; raises InvalidArgumentError naming a bad field."""
    return SamplingParams(
        temperature=message.temperature if message.HasField("temperature") else 1.0,
        top_k=message.top_k,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        min_p=message.min_p,
    )


def tree_to_wire(tree: TokenTree) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents)


def tree_from_wire(message: common_pb2.TokenTree) -> TokenTree:
    return TokenTree(tuple(message.tokens), tuple(message.parents))


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


def proposal_from_wire(message: common_pb2.Proposal, vocab_size: int) -> Proposal:
    """Decode into dense ``draft_probs`` [N, V] (exact zeros outside each row's support)."""
    tree = tree_from_wire(message.tree)
    scheme = _SCHEME_FROM_WIRE[message.sibling_sampling]
    if not message.HasField("draft"):
        return Proposal(tree, None, scheme)
    rows = torch.zeros(len(message.draft.rows), vocab_size, dtype=torch.float32)
    for index, row in enumerate(message.draft.rows):
        ids = torch.from_numpy(np.frombuffer(row.ids, dtype="<i4").astype(np.int64))
        probs = torch.from_numpy(np.frombuffer(row.probs, dtype="<f4").copy())
        if ids.numel() != probs.numel() or (ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size)):
            raise ValueError(f"draft row {index}: ids and probs must match and lie in [0, {vocab_size})")
        rows[index, ids] = probs
    node_rows = torch.tensor(list(message.draft.node_rows), dtype=torch.long)
    if node_rows.numel() != len(tree) or (len(tree) and int(node_rows.max()) >= len(rows)):
        raise ValueError("draft.node_rows must name one existing row per tree node")
    return Proposal(tree, rows[node_rows] if len(tree) else None, scheme)


def _sparse_row(row: torch.Tensor) -> common_pb2.SparseRow:
    ids = torch.nonzero(row > 0).flatten()
    return common_pb2.SparseRow(
        ids=ids.numpy().astype("<i4").tobytes(), probs=row[ids].float().numpy().astype("<f4").tobytes()
    )
