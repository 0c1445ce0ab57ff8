"""The transport to an OpenAI-compatible chat-completions endpoint: retries with backoff, JSON mode where the server
takes it, call and token budgets, and usage counts. It knows nothing of kernels; the key is read from the
environment and never kept in what it reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import openai

from agent.config import LlmSettings


class EndpointFailed(Exception):
    """The endpoint failed past the retries, or in a way retrying cannot fix."""


class BudgetSpent(Exception):
    """A call or token budget is used up."""


@dataclass
class Usage:
    """What the endpoint cost so far: calls (one a prompt sent, however many attempts it took: what `show --llm`
    lists and --llm-max-calls caps), failed attempts, retries, and tokens (estimated at about four characters a token
    where the server reports none)."""

    calls: int = 0
    failed_requests: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    estimated: bool = False

    def tokens(self) -> dict[str, Any]:
        return {"prompt": self.prompt_tokens, "completion": self.completion_tokens, "total": self.total_tokens,
                "estimated": self.estimated}


class ChatClient:
    def __init__(self, settings: LlmSettings, *, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.settings, self.backoff_s, self.max_backoff_s, self.sleep = settings, backoff_s, max_backoff_s, sleep
        self.client = openai.OpenAI(base_url=settings.base_url, api_key=LlmSettings.api_key() or "none",
                                    timeout=settings.timeout_s, max_retries=0)
        self.json_mode = True  # ask for response_format json_object until the endpoint refuses it
        self.usage = Usage()

    def complete(self, messages: list[dict[str, str]]) -> tuple[str, str | None]:
        """One chat completion (text, finish reason), retried on timeouts, connection errors, 429 and 5xx with
        exponential backoff; BudgetSpent or EndpointFailed when it cannot be had."""
        self._check_budget()
        self.usage.calls += 1
        attempt = 0
        while True:
            extra = {"response_format": {"type": "json_object"}} if self.json_mode else {}
            try:
                response = self.client.chat.completions.create(model=self.settings.model, messages=messages,
                                                               **extra)
            except openai.APIStatusError as e:
                if e.status_code in (400, 422) and self.json_mode:
                    self.json_mode = False  # many local servers reject response_format; the prompt asks for JSON
                    continue
                if e.status_code not in (408, 409, 429) and e.status_code < 500:
                    raise EndpointFailed(f"HTTP {e.status_code} ({type(e).__name__}): {_message(e)}") from None
                failure = f"HTTP {e.status_code} ({type(e).__name__})"
            except openai.APITimeoutError:
                failure = f"timeout after {self.settings.timeout_s:g} s"
            except openai.APIConnectionError as e:
                failure = f"connection error ({_message(e)})"
            else:
                self._count(response, messages)
                choice = response.choices[0] if response.choices else None
                return (choice.message.content or "") if choice else "", choice.finish_reason if choice else None
            self.usage.failed_requests += 1
            if attempt >= self.settings.retries:
                raise EndpointFailed(f"{failure}; gave up after {attempt + 1} attempts")
            self.sleep(min(self.backoff_s * 2**attempt, self.max_backoff_s))
            attempt += 1
            self.usage.retries += 1

    def _check_budget(self) -> None:
        if self.usage.calls >= self.settings.max_calls:
            raise BudgetSpent(f"max_calls ({self.settings.max_calls}) used")
        if self.usage.total_tokens >= self.settings.max_tokens:
            raise BudgetSpent(f"max_tokens ({self.settings.max_tokens}) used: {self.usage.total_tokens} tokens")

    def _count(self, response: Any, messages: list[dict[str, str]]) -> None:
        usage = getattr(response, "usage", None)
        if usage is not None and usage.total_tokens:
            prompt, completion, total = usage.prompt_tokens or 0, usage.completion_tokens or 0, usage.total_tokens
        else:  # servers that report no usage: about four characters a token
            self.usage.estimated = True
            prompt = sum(len(m["content"]) for m in messages) // 4
            completion = sum(len(c.message.content or "") for c in response.choices or []) // 4
            total = prompt + completion
        self.usage.prompt_tokens += prompt
        self.usage.completion_tokens += completion
        self.usage.total_tokens += total

    def endpoint(self) -> str:
        """Where the endpoint is, without user info or query (either may carry a secret)."""
        url = urlsplit(str(self.client.base_url))
        host = url.hostname or ""
        return f"{url.scheme}://{host}{f':{url.port}' if url.port else ''}{url.path}"

    def stats(self) -> dict[str, Any]:
        counts = {k: v for k, v in asdict(self.usage).items() if not k.endswith("tokens") and k != "estimated"}
        return {"endpoint": self.endpoint(), **counts, "tokens": self.usage.tokens(), "json_mode": self.json_mode}

    def close(self) -> None:
        self.client.close()


def _message(e: Exception) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"][:200]
    return str(e)[:200]
