"""Proto messages <-> the core types that need no tensors: sampling settings, token trees, log-probability
alternatives, a proposal's node count. The router uses only these (it relays draft rows and feature rows in their
encoded form); :mod:`grpc_common.convert_rows` decodes those rows for the workers.
"""

from __future__ import annotations

from specdec_wire.v1 import common_pb2

from specdec.sampling_params import SamplingParams, TopLogprobs
from specdec.tree import TokenTree

# nodes in one proposal, the workers' default bound: the router's largest tree (16 wide x 32 deep) fits
MAX_PROPOSAL_NODES = 512


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


def top_logprobs_to_wire(top: TopLogprobs) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def top_logprobs_from_wire(message: common_pb2.TopLogprobs) -> TopLogprobs:
    return TopLogprobs(tuple(message.token_ids), tuple(message.logprobs))


def tree_to_wire(tree: TokenTree) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents)


def tree_from_wire(message: common_pb2.TokenTree) -> TokenTree:
    return TokenTree(tuple(message.tokens), tuple(message.parents))


def proposal_nodes(message: common_pb2.Proposal) -> int:
    """The nodes of a proposal on the wire (what a Batch's node bound counts), without decoding it."""
    return len(message.tree.tokens)
