"""A public request, as both front doors (gRPC and OpenAI HTTP) decode it, and its validation into a plan.

:class:`GenerateInput` holds the fields as sent (unset numbers are ``None``); :func:`plan_request` checks them,
tokenizes, resolves the server defaults and returns the :class:`Plan` the round loop runs. Every rejection is
an :class:`~specdec.errors.InvalidArgumentError` naming the field, before any worker is touched: numbers are first
held to what their fields on the internal wire carry (int32 counts, float32 sampling settings, token ids), so
nothing valid here fails to encode later; then to what they mean (vLLM's conventions, e.g. ``top_k = -1`` is
"disabled").
"""

from __future__ import annotations

import math
import secrets
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal, cast

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from router.config import MAX_TREE_WIDTH, RouterConfig, check_tree_budget
from specdec.drafter_kinds import DRAFTER_KINDS
from specdec.errors import InvalidArgumentError
from specdec.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from specdec.tree import default_budget, sampled_tree_is_chain

Mode = Literal["off", "sequential", "pipelined", "auto"]
MODES: tuple[str, ...] = ("off", "sequential", "pipelined", "auto")
MAX_STOP_STRINGS = 16
UINT64 = 1 << 64
INT32_MAX = (1 << 31) - 1  # the largest count or token id an int32 wire field carries
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's message roles


@dataclass(frozen=True)
class Message:
    """One chat message."""

    role: str
    content: str


@dataclass(frozen=True)
class GenerateInput:
    """The public request as decoded from the wire; nothing is checked yet.

    Exactly one of ``prompt``, ``prompt_ids`` and ``messages`` is meant to be set; ``chat`` wraps ``prompt``
    in the chat template as one user message. ``speculation`` is ``""`` (server default) or one of
    :data:`MODES`; ``drafter`` is ``""`` (server default), ``"none"`` or a drafter kind.
    """

    prompt: str = ""
    prompt_ids: tuple[int, ...] = ()
    messages: tuple[Message, ...] = ()
    chat: bool = False
    model: str = ""
    temperature: float | None = None
    top_k: int = 0
    top_p: float | None = None
    min_p: float = 0.0
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculation: str = ""
    drafter: str = ""
    num_draft_tokens: int = 0
    tree_width: int = 0
    tree_budget: int = 0
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class DraftShape:
    """Candidate shape for the drafter: chain length / tree depth, children per node, node budget."""

    num_draft_tokens: int
    tree_width: int = 1
    tree_budget: int = 0

    @property
    def is_chain(self) -> bool:
        return self.tree_width <= 1

    @property
    def max_nodes(self) -> int:
        """Nodes of the whole shape (a drafter's ``DraftConfig.max_nodes``)."""
        return self.tree_budget or self.tree_width * self.num_draft_tokens


@dataclass(frozen=True)
class Plan:
    """A validated request, ready for the round loop.

    ``mode`` is the speculation asked for (or the server's default; ``"auto"``: pipelined rounds whose draft
    length adapts, see :mod:`router.pipeline`); trees pipeline like chains.
    ``drafter_kind`` is ``None`` for any kind. ``eos_token_ids`` only tells "stop" from "length" when EOS is
    the last token the budget allows; the verifier decides when generation ends.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    seed: int
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: bool
    mode: Mode
    drafter_kind: str | None
    shape: DraftShape
    eos_token_ids: frozenset[int]
    top_logprobs: int = 0  # with logprobs: alternatives per generated token


def plan_request(
    request: GenerateInput,
    config: RouterConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    drafter_kinds: Collection[str],
    *,
    default_max_tokens: int | None = None,
) -> Plan:
    """Validate ``request`` and resolve it into a :class:`Plan`.

    ``drafter_kinds`` are the kinds the router's drafters serve (an empty collection: kinds unknown yet, any is
    let through and falls back to target-only if none turns up). ``default_max_tokens`` overrides the config's
    default for an unset ``max_tokens`` (the completions API defaults to 16).
    """
    if request.model and request.model != config.model:
        raise InvalidArgumentError("model", f"unknown model {request.model!r}; this router serves {config.model!r}")
    _check_int32(request)
    prompt_ids = _prompt_ids(request, tokenizer)
    max_tokens = request.max_tokens if request.max_tokens is not None else default_max_tokens
    max_tokens = config.default_max_tokens if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise InvalidArgumentError("max_tokens", f"must be >= 1, got {max_tokens}")
    if config.max_model_len:
        if len(prompt_ids) >= config.max_model_len:
            raise InvalidArgumentError(
                "prompt", f"{len(prompt_ids)} tokens leave no room in the context length {config.max_model_len}"
            )
        if len(prompt_ids) + max_tokens > config.max_model_len:
            raise InvalidArgumentError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                f"{config.max_model_len}",
            )
    if request.top_k < -1:
        raise InvalidArgumentError("top_k", f"must be -1 or 0 (disabled) or a count >= 1, got {request.top_k}")
    sampling = SamplingParams(
        temperature=_float32("temperature", 1.0 if request.temperature is None else request.temperature),
        top_k=max(request.top_k, 0),
        top_p=_float32("top_p", 1.0 if request.top_p is None else request.top_p),
        min_p=_float32("min_p", request.min_p),
    )
    if request.seed is not None and not 0 <= request.seed < UINT64:
        raise InvalidArgumentError("seed", f"must be in [0, 2^64), got {request.seed}")
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
    if request.top_logprobs and not request.logprobs:
        raise InvalidArgumentError("top_logprobs", "needs logprobs")
    _check_stop(request.stop, tokenizer)
    mode, kind = _speculation(request, config, drafter_kinds)
    shape = _shape(request, config, sampling)
    eos = frozenset(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos |= {int(tokenizer.eos_token_id)}
    return Plan(
        prompt_ids=prompt_ids,
        sampling=sampling,
        max_tokens=max_tokens,
        seed=secrets.randbits(63) if request.seed is None else request.seed,
        stop=request.stop,
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        mode=mode,
        drafter_kind=kind,
        shape=shape,
        eos_token_ids=frozenset() if request.ignore_eos else eos,
    )


def _check_int32(request: GenerateInput) -> None:
    """Every integer that travels as an int32 on the internal wire (counts and token ids) fits in one."""
    counts = {
        "max_tokens": request.max_tokens,
        "top_k": request.top_k,
        "num_draft_tokens": request.num_draft_tokens,
        "tree_width": request.tree_width,
        "tree_budget": request.tree_budget,
        "top_logprobs": request.top_logprobs,
    }
    for name, value in counts.items():
        if value is not None and not -INT32_MAX - 1 <= value <= INT32_MAX:
            raise InvalidArgumentError(name, f"must be a 32-bit integer ([{-INT32_MAX - 1}, {INT32_MAX}]), got {value}")
    if any(not 0 <= token <= INT32_MAX for token in request.prompt_ids):
        raise InvalidArgumentError("prompt_ids", f"token ids must be in [0, {INT32_MAX}]")


def _float32(name: str, value: float) -> float:
    """``value`` as the float32 the internal wire carries (so the plan checks what the workers will read)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0] if math.isfinite(value) else value
    except OverflowError:
        raise InvalidArgumentError(name, f"must be a finite 32-bit float, got {value}") from None


def _prompt_ids(request: GenerateInput, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    given = [name for name, value in (("prompt", request.prompt), ("prompt_ids", request.prompt_ids)) if value]
    if request.messages:
        given.append("messages")
    if len(given) > 1:
        raise InvalidArgumentError(
            given[1], f"set only one of prompt, prompt_ids and messages (got {', '.join(given)})"
        )
    if not given:
        raise InvalidArgumentError("prompt", "must not be empty")
    if request.prompt_ids:
        if request.chat:
            raise InvalidArgumentError("chat", "applies to a text prompt, not to prompt_ids")
        return tuple(request.prompt_ids)
    field = "messages" if request.messages else "prompt"
    if tokenizer is None:
        raise InvalidArgumentError(field, "this router has no tokenizer; send prompt_ids")
    if request.messages or request.chat:
        messages = request.messages or (Message("user", request.prompt),)
        for index, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidArgumentError(
                    f"messages[{index}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}"
                )
        if tokenizer.chat_template is None:
            raise InvalidArgumentError("chat" if request.chat else field, "the served model has no chat template")
        try:
            ids = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        except TemplateError as error:  # the template's own checks (e.g. roles in a given order)
            raise InvalidArgumentError(field, f"the model's chat template refused them: {error}") from None
    else:
        ids = tokenizer.encode(request.prompt, add_special_tokens=False)
    if not ids:
        raise InvalidArgumentError(field, "tokenizes to no tokens")
    return tuple(int(token) for token in ids)


def _check_stop(stops: tuple[str, ...], tokenizer: PreTrainedTokenizerBase | None) -> None:
    if not stops:
        return
    if tokenizer is None:
        raise InvalidArgumentError("stop", "stop strings need a tokenizer; this router serves token ids only")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgumentError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not stop for stop in stops):
        raise InvalidArgumentError("stop", "stop strings must not be empty")


def _speculation(request: GenerateInput, config: RouterConfig, kinds: Collection[str]) -> tuple[Mode, str | None]:
    """The mode and the drafter kind (None: any) for ``request``."""
    if request.speculation not in ("", *MODES):
        raise InvalidArgumentError("speculation", f"must be one of {', '.join(MODES)}, got {request.speculation!r}")
    kind = request.drafter or config.default_drafter
    if kind not in ("", *DRAFTER_KINDS):
        raise InvalidArgumentError("drafter", f"unknown drafter kind {kind!r}; one of {', '.join(DRAFTER_KINDS)}")
    if request.drafter and request.drafter != "none" and kinds and request.drafter not in kinds:
        raise InvalidArgumentError(
            "drafter", f"no {request.drafter!r} drafter is served here (served: {', '.join(sorted(kinds))})"
        )
    if request.speculation == "off" or kind == "none" or not config.drafters:
        return "off", None
    return cast(Mode, request.speculation or config.default_speculation), kind or None


def _shape(request: GenerateInput, config: RouterConfig, sampling: SamplingParams) -> DraftShape:
    """The request's candidate shape; what it leaves at 0 is the server's. A request that names no tree width takes
    the server's width and budget (the budget capped at what its own depth holds; unset, as many nodes as its depth);
    one that names a width, its own budget (0: the width a level). A sampled request's tree that is a chain
    (:func:`specdec.tree.sampled_tree_is_chain`) is planned as that chain: so the server's default shape, the 4 most
    probable nodes of a tree 4 deep, is a chain of 4 for a sampled request."""
    gamma = request.num_draft_tokens or config.num_draft_tokens
    if not 1 <= gamma <= config.max_draft_tokens:
        raise InvalidArgumentError("num_draft_tokens", f"must be in [0, {config.max_draft_tokens}], got {gamma}")
    if not 0 <= request.tree_width <= MAX_TREE_WIDTH:
        raise InvalidArgumentError("tree_width", f"must be in [0, {MAX_TREE_WIDTH}], got {request.tree_width}")
    if request.tree_width:
        width, budget = request.tree_width, request.tree_budget
    else:
        server_budget = default_budget(config.tree_width, gamma) if config.tree_budget is None else config.tree_budget
        width, budget = config.tree_width, request.tree_budget or min(server_budget, config.tree_width * gamma)
    check_tree_budget(budget, width, gamma)
    if not sampling.greedy and sampled_tree_is_chain(width, budget, gamma):
        return DraftShape(budget)
    return DraftShape(gamma, width, budget)
