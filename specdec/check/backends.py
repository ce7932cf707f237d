"""How ``specdec check`` talks to a router: the gRPC SDK (:mod:`specdec.client`) or the OpenAI-compatible HTTP API.

Both turn one request into a :class:`Generation`: the generated tokens and whether the generation finished (EOS)
before its budget. Over gRPC the tokens are ids; over HTTP they are the per-token strings of the completion's
``logprobs.tokens`` (the HTTP API returns no ids): a coarsening of the ids applied to both samples alike, so the
law comparison stays valid (equal laws of ids give equal laws of their strings).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from specdec.errors import SpecdecError

MAX_RETRIES = 20


class CheckRequestError(SpecdecError):
    """A request of the check failed for a reason other than overload."""


@dataclass(frozen=True)
class Prompt:
    """A prompt as text (tokenized by the router) or as token ids; ``label`` names it in the report."""

    label: str
    text: str | None = None
    ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Generation:
    """The tokens of one generation and whether it stopped (EOS) rather than ran out of ``max_tokens``."""

    tokens: tuple[Hashable, ...]
    finished: bool


class Backend(Protocol):
    """One router, through one of its front doors."""

    async def generate(self, prompt: Prompt, *, chat: bool, options: Mapping[str, Any]) -> Generation:
        """One request; ``options`` are :class:`specdec.client.GenerateOptions` keys."""
        ...

    async def drafter_kinds(self) -> tuple[str, ...] | None:
        """The drafter kinds the router serves, or None when this front door cannot tell."""
        ...

    async def close(self) -> None: ...


class GrpcBackend:
    """The router's gRPC API through :class:`specdec.client.AsyncClient`; create it inside the running loop."""

    def __init__(self, address: str, *, tls: bool, bearer_token: str | None, timeout_s: float) -> None:
        from specdec.client import AsyncClient

        self.address = address
        self._client = AsyncClient(address, timeout_s=timeout_s, tls=tls, bearer_token=bearer_token)

    async def generate(self, prompt: Prompt, *, chat: bool, options: Mapping[str, Any]) -> Generation:
        from specdec.client import ClientError, Overloaded

        for _ in range(MAX_RETRIES):
            try:
                if prompt.ids is not None:
                    result = await self._client.generate(prompt_ids=prompt.ids, **options)
                else:
                    result = await self._client.generate(prompt.text, chat=chat, **options)
            except Overloaded as error:
                await asyncio.sleep(error.retry_after_s or 1.0)
                continue
            except ClientError as error:
                raise CheckRequestError(f"router {self.address}: {error}") from None
            return Generation(tuple(result.token_ids), result.finish_reason == "stop")
        raise CheckRequestError(f"router {self.address}: still overloaded after {MAX_RETRIES} retries")

    async def drafter_kinds(self) -> tuple[str, ...] | None:
        from specdec.client import ClientError

        try:
            status = await self._client.status()
        except ClientError as error:
            raise CheckRequestError(f"router {self.address}: status: {error}") from None
        return tuple(sorted({w.kind for w in status.workers if w.role == "drafter" and w.kind}))

    async def close(self) -> None:
        await self._client.close()


class HttpBackend:
    """The router's OpenAI-compatible HTTP API (``/v1/completions``, ``/v1/chat/completions`` when ``chat``).

    ``https://`` URLs verify the server against the system roots, as the SDK's ``tls=True`` does.
    """

    def __init__(self, base_url: str, *, bearer_token: str | None, timeout_s: float) -> None:
        import aiohttp  # here: `specdec` (whose CLI registers the check) must start without it

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {bearer_token}"} if bearer_token else {}
        self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s))
        self._client_errors = (aiohttp.ClientError, TimeoutError)

    def _body(self, prompt: Prompt, chat: bool, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {key: value for key, value in options.items()}
        body["logprobs"] = True if chat else 1  # the per-token strings are what the check compares
        if chat:
            if prompt.text is None:
                raise CheckRequestError("chat prompts must be text, not token ids")
            body["messages"] = [{"role": "user", "content": prompt.text}]
            return "/v1/chat/completions", body
        body["prompt"] = list(prompt.ids) if prompt.ids is not None else prompt.text
        return "/v1/completions", body

    async def generate(self, prompt: Prompt, *, chat: bool, options: Mapping[str, Any]) -> Generation:
        path, body = self._body(prompt, chat, options)
        for _ in range(MAX_RETRIES):
            try:
                async with self._session.post(self.base_url + path, json=body) as response:
                    if response.status == 429:
                        await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                        continue
                    answer = await response.json(content_type=None)
            except self._client_errors as error:
                raise CheckRequestError(f"{self.base_url}{path}: {error!r}") from None
            if response.status != 200:
                message = answer.get("error", {}).get("message") if isinstance(answer, dict) else answer
                raise CheckRequestError(f"{self.base_url}{path}: HTTP {response.status}: {message}")
            choice = answer["choices"][0]
            logprobs = choice.get("logprobs") or {}
            if chat:
                tokens = tuple(entry["token"] for entry in logprobs.get("content") or ())
            else:
                tokens = tuple(logprobs.get("tokens") or ())
            return Generation(tokens, choice.get("finish_reason") == "stop")
        raise CheckRequestError(f"{self.base_url}{path}: still overloaded after {MAX_RETRIES} retries")

    async def drafter_kinds(self) -> tuple[str, ...] | None:
        return None  # the HTTP API does not list workers

    async def close(self) -> None:
        await self._session.close()
