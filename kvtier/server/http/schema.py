"""Request bodies of the OpenAI-compatible endpoints. Unknown fields are refused, not ignored:
a client that sends `max_token` by mistake learns it at once instead of getting a default.

A misspelt required field (`mesages`) is two errors to pydantic: `messages` missing and
`mesages` unknown. The unknown one is reported first, since it names the typo; the server's
error body then lists the fields it accepts."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    field_validator,
    model_validator,
)

from kvtier.server.decoding import GREEDY_BELOW


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


class FunctionCall(_Strict):
    name: str
    arguments: str  # the JSON text of an object, as the server returned it


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None

    def rendered(self) -> dict[str, Any]:
        """The message as `kvtier.server.decoding.tools.render_prompt` takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, params: dict[str, Any] | None) -> dict[str, Any] | None:
        # a call's arguments are a JSON object (OpenAI's, and the hermes format's): a schema of
        # anything else could never make a call
        if params is not None and params.get("type", "object") != "object":
            raise ValueError(
                f"parameters has type {params.get('type')!r}; a function's parameters are a "
                'JSON Schema of an object: {"type": "object", "properties": {...}}'
            )
        return params


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaFormat(_Strict):
    name: str = "reply"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Stop strings a request may send, and their length: each token's text is searched for every
# one of them on the scheduler's thread (OpenAI allows 4).
MAX_STOPS = 32
MAX_STOP_CHARS = 256
# A temperature below this samples as greedy, as vLLM's does (kvtier.server.decoding.sampling)
# `seed` seeds a 64-bit generator: the range of a signed 64-bit integer, as vLLM accepts
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # vLLM's extension
    # vLLM's extension: the end-of-sequence token does not end the reply, which runs on to
    # max_tokens (benchmarks that need replies of a fixed length). Strict: pydantic would
    # otherwise read "yes" or 1 as true, and a client that sends the wrong type should learn it
    ignore_eos: bool = Field(default=False, strict=True)

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, t: float) -> float:
        return 0.0 if t < GREEDY_BELOW else t

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        listed = [stop] if isinstance(stop, str) else stop or []
        if len(listed) > MAX_STOPS:
            raise ValueError(
                f"{len(listed)} stop strings; send at most {MAX_STOPS} (each token's text is "
                "searched for every one)"
            )
        long = max((len(s) for s in listed), default=0)
        if long > MAX_STOP_CHARS:
            raise ValueError(
                f"a stop string of {long} characters; use at most {MAX_STOP_CHARS} per string"
            )
        return stop

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(
                f"n={n}: kvtier generates one choice per request (each reply extends the "
                "session's cache); send n requests, with distinct seeds for distinct replies"
            )
        return n

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return tuple(s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The tools offered to the model (none with tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def format_dict(self) -> dict[str, Any] | None:
        if self.response_format is None:
            return None
        return self.response_format.model_dump(by_alias=True, exclude_none=True)

    def choice(self) -> Any:
        c = self.tool_choice
        return c.model_dump() if isinstance(c, NamedToolChoice) else c

    def top(self) -> int | None:
        """Top ids to report per token; None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    # text, or token ids as OpenAI and vLLM take them (a trace replay's prompts: no tokenizer
    # between the client's ids and the cache's keys); an id the model cannot embed is a 400
    prompt: str | list[Annotated[int, Field(ge=0)]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def top(self) -> int | None:
        return self.logprobs
