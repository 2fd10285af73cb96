"""The OpenAI request bodies this server accepts, checked by pydantic, and the OpenAI error shape.

What is not supported is refused by name (400) rather than ignored: n > 1, logprobs, echo, best_of,
suffix, logit_bias, presence/frequency penalties, tools, and a response_format other than text.
Extensions (not in OpenAI's API): `top_k`, and the speculative `method` / `gamma` / `tree` /
`suffix_cache`. OpenAI's `user` scopes the suffix cache (method suffix).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specexport.errors import SpecexportError
from specexport.runtime.methods import METHODS
from specexport.runtime.sampling import MIN_TEMPERATURE      # below it: greedy, as vLLM does

MethodName = Literal[("auto", *METHODS)]                    # in the OpenAPI schema as an enum


class RequestError(SpecexportError):
    """A request the server refuses: answered with `status` and OpenAI's error body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code
        self.headers = headers or {}            # e.g. Retry-After with a 429

    def body(self) -> dict:
        return error_body(str(self), param=self.param, kind=self.kind, code=self.code)


def error_body(message: str, *, param=None, kind: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape (documented in the OpenAPI schema for every error status)."""
    error: ErrorDetail


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)                  # extension
    seed: int | None = Field(None, ge=0, le=2 ** 64 - 1)
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    method: MethodName | None = None                       # extension: auto or one of the runtime's METHODS
    gamma: int | None = Field(None, ge=1)                  # extension: chain length (draft, lookup)
    tree: Union[str, list[list[int]], dict[str, int], None] = None   # extension: a named tree, rank paths, or
                                                                     # EAGLE's {top_k, depth, total_tokens}
    suffix_cache: bool = True                              # extension: false: method suffix neither reads the
                                                           # server's cache of earlier answers nor adds this one
    # accepted for refusal by name
    logprobs: Union[bool, int, None] = None
    top_logprobs: int | None = None
    logit_bias: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @model_validator(mode="after")
    def _supported(self):
        refuse = {"n": self.n != 1, "logprobs": bool(self.logprobs), "top_logprobs": bool(self.top_logprobs),
                  "logit_bias": bool(self.logit_bias), "presence_penalty": self.presence_penalty != 0,
                  "frequency_penalty": self.frequency_penalty != 0}
        for name, bad in refuse.items():
            if bad:
                raise ValueError(f"{name}: not supported by this server (the runtime decodes one sequence "
                                 f"without penalties or logprobs)")
        stops = self.stop_list
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def stream_kwargs(self, max_new_tokens: int) -> dict:
        """Pipeline.stream keyword arguments (method is resolved by the worker)."""
        temperature = self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0
        out = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": self.seed,
               "top_k": self.top_k, "top_p": None if self.top_p == 1.0 else self.top_p, "stop": self.stop_list,
               "method": self.method}
        if self.gamma is not None:
            out["gamma"] = self.gamma
        if self.tree is not None:
            out["tree"] = self.tree
        # The suffix cache is scoped by OpenAI's `user` field: one user's lookups never see another's text
        out["suffix_scope"], out["suffix_share"] = self.user or "", self.suffix_cache
        return out


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    max_tokens: int | None = Field(16, ge=1)               # OpenAI's default for completions
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) > 1:
            raise ValueError("prompt: one prompt per request (send several requests at once: the server batches them)")
        if self.prompt == [] or self.prompt == "":
            raise ValueError("prompt: empty")
        for name, bad in {"echo": self.echo, "best_of": (self.best_of or 1) != 1, "suffix": bool(self.suffix)}.items():
            if bad:
                raise ValueError(f"{name}: not supported by this server")
        return self


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise ValueError("messages: only text content parts are supported")
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.tools:
            raise ValueError("tools: not supported by this server")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        for m in self.messages:
            m.text()                                        # raises on non-text parts
        return self

    def rendered_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
