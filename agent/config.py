"""Run configuration and LLM endpoint settings (validated; the API key is never stored)."""

from __future__ import annotations

import os
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

Proposer = Literal["builtin", "llm", "mixed"]


class LlmSettings(BaseModel):
    """Where the OpenAI-compatible endpoint is. The key is read from the environment when needed, never saved."""

    model_config = ConfigDict(frozen=True)

    base_url: str | None = None
    model: str = "gpt-4o-mini"
    max_calls: int = Field(20, ge=0)
    max_tokens: int = Field(700_000, ge=0)  # 20 calls of a full prompt (~32k tokens) fit
    # a prompt's estimated size, all family templates included (sm90_wgmma's alone is ~11k); parts are cut to fit
    max_prompt_tokens: int = Field(32_000, ge=2_000)
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    retries: int = Field(2, ge=0)

    @field_validator("base_url")
    @classmethod
    def _http_without_credentials(cls, url: str | None) -> str | None:
        """An http(s) URL with a host, checked before a run starts; user:password@ in it would be saved with the
        run, so it is dropped (the key comes from the environment)."""
        if url is None:
            return None
        parts = urlsplit(url)
        try:
            host, _ = parts.hostname or "", parts.port  # a port that is not a number raises here
        except ValueError as e:
            raise ValueError(f"{url!r} is not a usable URL ({e})") from None
        if parts.scheme not in ("http", "https") or not host:
            raise ValueError(f"expected an http:// or https:// URL such as http://localhost:8000/v1, got {url!r}")
        netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))

    @classmethod
    def from_env(cls, **overrides) -> LlmSettings:
        values = {"base_url": os.environ.get("OPENAI_BASE_URL"), "model": os.environ.get("OPENAI_MODEL")}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**{k: v for k, v in values.items() if v is not None})

    @staticmethod
    def api_key() -> str:
        return os.environ.get("OPENAI_API_KEY", "")

    def missing(self) -> str | None:
        """What stops a call to the endpoint before it is made, or None: the public endpoint needs a key, a local
        one an address."""
        if self.base_url is None and not self.api_key():
            return ("--proposer llm/mixed needs an endpoint: set OPENAI_API_KEY (OpenAI), or OPENAI_BASE_URL / "
                    "--llm-base-url (an OpenAI-compatible server such as vLLM or Ollama)")
        return None


class RunConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    budget_minutes: float = Field(5.0, gt=0, allow_inf_nan=False)
    max_candidates: int = Field(16, ge=1, description="per shape")
    proposer: Proposer = "builtin"
    arch: Literal["sm_90a", "sm_80"] | None = None  # None: from the GPU, or sm_90a when compiling only
    compile_only: bool = False
    kernel_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False, description="slack beyond a phase's expected time")
    compile_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    seed: int = 0
    # profile each shape's leaders with Nsight Compute (where it is installed); None: where a proposer reads them
    profile: bool | None = None
    tuning_db: str | None = None  # the tuning database results are kept in and learned from; None: neither
    llm: LlmSettings = LlmSettings()

    @property
    def profiles(self) -> bool:
        """Whether the run profiles: as asked (--profile, --no-profile), else only where something reads the
        profiles, the LLM's prompt (--proposer llm or mixed); `show` prints them too."""
        return self.profile if self.profile is not None else self.proposer != "builtin"
