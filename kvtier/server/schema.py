"""Request bodies of the OpenAI-compatible endpoints. Unknown fields are refused, not ignored:
a client that sends `max_token` by mistake learns it at once instead of getting a default.

A misspelt required field (`mesages`) is two errors to pydantic: `messages` missing and
`mesages` unknown. The unknown one is reported first, since it names the typo; the server's
error body then lists the fields it accepts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    model_validator,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _unknown_fields_first(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        try:
            return handler(data)
        except ValidationError as exc:
            raise unknown_fields_first(exc) from None


def _is_unknown(err: Any) -> bool:
    return bool(err["type"] == "extra_forbidden" and len(err["loc"]) == 1)


def unknown_fields_first(exc: ValidationError) -> ValidationError:
    """The same errors, this model's own unknown fields first (a typo explains the rest)."""
    errors = exc.errors()
    if not errors or _is_unknown(errors[0]) or not any(_is_unknown(e) for e in errors):
        return exc
    ordered = sorted(errors, key=lambda e: not _is_unknown(e))
    details: list[Any] = []  # pydantic_core.InitErrorDetails
    for e in ordered:
        d: dict[str, Any] = {"type": e["type"], "loc": e["loc"], "input": e["input"]}
        if "ctx" in e:
            d["ctx"] = e["ctx"]
        details.append(d)
    try:
        return ValidationError.from_exception_data(exc.title, details)
    except (TypeError, ValueError, KeyError):  # an error type that cannot be rebuilt: as it was
        return exc


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)  # penalties are not supported
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return tuple(s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str
    max_tokens: int | None = Field(default=16, ge=1)
