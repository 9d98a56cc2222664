"""OpenAI Batch API lines, so existing batch tooling works unchanged.

Input: one ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` or ``/v1/embeddings``
request per line, each read into a job here. The output lines are ``schemas.openai_output``'s.

Bodies take vLLM's own request fields beside OpenAI's, as vLLM's server does (``VLLM_FIELDS``),
so a file written for ``vllm run-batch`` runs unchanged; ``strict`` (``VQUEUE_OPENAI_STRICT``)
refuses them as OpenAI's API does, each such request failing alone.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .jobs import (
    MAX_EMBED_INPUTS,
    MAX_OUTPUT_TOKENS,
    MAX_TEXT_CHARS,
    ChatJob,
    ChatMessage,
    EmbedJob,
    Format,
    Tool,
    ToolChoice,
    Unsupported,
    tool_call_schema,
)

# Body fields that change nothing for a batch run by vqueue, taken and ignored as OpenAI's batch
# takes them: who asked, storage and tiers, reasoning hints for models that have none here
IGNORED_FIELDS = frozenset({
    "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "store",
    "service_tier", "stream_options", "reasoning_effort", "verbosity",
})  # fmt: skip


def _first_refused(
    asks: list[tuple[str, bool, str]], extra: dict[str, Any] | None
) -> Unsupported | None:
    """The first of a body's ``(field, asked, why vqueue does not)`` that it asks for, else its
    first field OpenAI does not know (what is not typed, nor taken and ignored); None when it
    asks for nothing vqueue cannot do."""
    for param, asked, why in asks:
        if asked:
            return Unsupported(param=param, message=f"{param}: vqueue {why}")
    unknown = sorted(set(extra or {}) - IGNORED_FIELDS)
    if unknown:
        return Unsupported(param=unknown[0], message=f"Unrecognized request argument "
                           f"supplied: {unknown[0]}")  # fmt: skip
    return None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    # {"name": ..., "schema": {...}, "strict": ...} when type is json_schema
    json_schema: dict[str, Any] | None = None


class _VllmFields(BaseModel):
    """vLLM's own sampling fields, which its server (and ``vllm run-batch``) takes in a
    request's body beside OpenAI's: a file written for vLLM runs here unchanged."""

    min_tokens: int | None = Field(default=None, ge=0, le=MAX_OUTPUT_TOKENS)
    ignore_eos: bool | None = None
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)


# vLLM's request fields, beyond OpenAI's, that these bodies take (docs/http-api.md lists them)
VLLM_FIELDS = (*_VllmFields.model_fields, "structured_outputs", "guided_json",
               "truncate_prompt_tokens")  # fmt: skip


def strict_refusal(body: BaseModel) -> Unsupported | None:
    """Under ``strict``: the first vLLM field ``body`` sets, refused as OpenAI's API refuses a
    field it does not know."""
    for name in VLLM_FIELDS:
        if getattr(body, name, None) is not None:
            return Unsupported(param=name, message=f"Unrecognized request argument supplied: "
                               f"{name}")  # fmt: skip
    return None


class ChatCompletionBody(_VllmFields):
    """A ``/v1/chat/completions`` body as OpenAI's batch files carry it. Fields vqueue honours
    are typed; fields that change nothing for a batch (``user``, ``store``, ...) are taken and
    ignored, as OpenAI's own batch does; what vqueue does not do (``unsupported``) fails that
    request alone with a 400 naming the field, and an unknown field likewise."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # as _JobBase's
    stop: str | list[str] | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, Any] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool | None = None
    # checked in ``to_job``: a request whose tools do not parse fails alone, naming them
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # vLLM's guided decoding in the body: ``structured_outputs`` (``{"json": schema}``, or
    # ``{"json_object": true}``) and the older ``guided_json``, each the same as a
    # response_format; other kinds (regex, grammar, choice) fail the request alone
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None

    def guided_schema(self) -> dict[str, Any] | None:
        """The JSON Schema that ``guided_json`` or ``structured_outputs`` asks for."""
        schema = self.guided_json
        if self.structured_outputs is not None:
            schema = self.structured_outputs.get("json", schema)
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ValueError("guided_json must be a JSON Schema (an object)") from None
        if schema is not None and not isinstance(schema, dict):
            raise ValueError("guided_json must be a JSON Schema (an object)")
        return schema

    def unsupported(self) -> Unsupported | None:
        """The first field of this body vqueue cannot honour, and why; None when it can."""
        asks = [
            (
                "top_logprobs",
                self.top_logprobs is not None and not self.logprobs,
                "takes top_logprobs only beside logprobs: true",
            ),
            ("stream", bool(self.stream), "a batch request is not streamed"),
            ("functions", bool(self.functions), "takes functions as tools"),
            ("function_call", self.function_call not in (None, "none"), "takes tool_choice"),
            ("modalities", any(m != "text" for m in self.modalities or []), "answers text only"),
            ("audio", self.audio is not None, "answers text only"),
            ("prediction", self.prediction is not None, "takes no predicted output"),
            ("web_search_options", self.web_search_options is not None, "does not search"),
            (
                "structured_outputs",
                bool(set(self.structured_outputs or {}) - {"json", "json_object"}),
                "guides decoding by a JSON Schema or JSON object only",
            ),
        ]
        return _first_refused(asks, self.model_extra)


# OpenAI's legacy completions default, which vLLM's endpoint keeps: a line without max_tokens
# gets 16 tokens, as it would there
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
COMPLETIONS_MAX_LOGPROBS = 5  # OpenAI's bound on a completion's logprobs


class CompletionBody(_VllmFields):
    """A ``/v1/completions`` body: a bare prompt, no chat template. Typed and ignored fields as
    ``ChatCompletionBody``; one prompt per request (a string, or a list holding one)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1, le=128)
    logprobs: int | None = Field(default=None, ge=0, le=COMPLETIONS_MAX_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None

    def text(self) -> str | None:
        """The one prompt, or None when the body holds several (each would be its own answer)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if len(self.prompt) == 1 else None

    def unsupported(self) -> Unsupported | None:
        n = self.n or 1
        asks = [
            ("prompt", self.text() is None, "takes one prompt per request (split the list)"),
            (
                "prompt",
                len(self.text() or "") > MAX_TEXT_CHARS,
                f"takes prompts of at most {MAX_TEXT_CHARS:,} characters",
            ),  # fmt: skip
            ("best_of", (self.best_of or n) != n, "returns every answer it generates (n)"),
            ("echo", bool(self.echo), "does not echo the prompt"),
            ("suffix", self.suffix is not None, "does not insert text (suffix)"),
            ("stream", bool(self.stream), "a batch request is not streamed"),
        ]
        return _first_refused(asks, self.model_extra)


def _sampling(body: BaseModel) -> dict[str, Any]:
    """The sampling fields a body set, as a chat job's: what it left out keeps the job's
    defaults; ``stop`` as a list."""
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "n",
                 *_VllmFields.model_fields):  # fmt: skip
        if getattr(body, name, None) is not None:
            out[name] = getattr(body, name)
    if getattr(body, "logit_bias", None):
        out["logit_bias"] = body.logit_bias  # type: ignore[attr-defined]
    stop = getattr(body, "stop", None)
    out["stop"] = [stop] if isinstance(stop, str) else (stop or [])
    return out


class _RequestLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=256)
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"]


# Response items a request's ``input`` may hold, and the content parts of each: text only
_TEXT_PARTS = {"input_text", "output_text", "text"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# what ``include`` may ask for: the answer's logprobs (``top_logprobs`` alternatives each)
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class ResponsesBody(BaseModel):
    """A ``/v1/responses`` body: ``input`` (a string, or message items with text content),
    ``instructions`` as the system turn, ``text.format`` for JSON. Typed and ignored fields as
    ``ChatCompletionBody``; tools, conversations and streaming fail the request alone."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool | None = None
    background: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None

    def messages(self) -> list[ChatMessage] | Unsupported:
        """``instructions`` then ``input`` as chat messages; or what in them vqueue cannot
        read (an item that is not a text message)."""
        out = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, ChatMessage(role="user", content=self.input)]
        for i, item in enumerate(self.input):
            role, content = item.get("role"), item.get("content")
            if item.get("type", "message") != "message" or role not in _ROLES:
                what = item.get("type") or role
                return Unsupported(param="input", message=f"input[{i}]: vqueue takes message "
                                   f"items with a role, not {str(what)[:40]!r}")  # fmt: skip
            if isinstance(content, list):
                kinds = [p.get("type") if isinstance(p, dict) else None for p in content]
                if not content or any(k not in _TEXT_PARTS for k in kinds):
                    other = next((k for k in kinds if k not in _TEXT_PARTS), None)
                    return Unsupported(param="input", message=f"input[{i}]: vqueue answers text "
                                       f"only, not {str(other)[:40]!r} content")  # fmt: skip
                content = "".join(str(p.get("text", "")) for p in content)
            if not isinstance(content, str):
                return Unsupported(param="input", message=f"input[{i}]: content must be text")
            out.append(ChatMessage(role=_ROLES[role], content=content))  # type: ignore[arg-type]
        return out

    def unsupported(self) -> Unsupported | None:
        fmt = (self.text or {}).get("format") or {}
        asks = [
            ("tools", bool(self.tools), "does not call tools"),
            ("tool_choice", self.tool_choice not in (None, "none", "auto"), "does not call tools"),
            ("stream", bool(self.stream), "a batch request is not streamed"),
            ("background", bool(self.background), "runs every batch request in the background"),
            ("previous_response_id", self.previous_response_id is not None,
             "keeps no responses to continue (send the whole conversation as input)"),
            ("conversation", self.conversation is not None, "keeps no conversations"),
            ("prompt", self.prompt is not None, "keeps no prompt templates"),
            ("include", any(x != INCLUDE_LOGPROBS for x in self.include or []),
             f"includes {INCLUDE_LOGPROBS} only"),
            ("text", fmt.get("type", "text") not in ("text", "json_object", "json_schema"),
             "takes text.format text, json_object or json_schema"),
            ("text", fmt.get("type") == "json_schema" and not isinstance(fmt.get("schema"), dict),
             "needs text.format.schema, a JSON Schema object"),
        ]  # fmt: skip
        return _first_refused(asks, self.model_extra)


class ResponsesRequestInput(_RequestLine):
    """One ``/v1/responses`` input line; ``custom_id`` becomes the job id."""

    body: ResponsesBody
    format: ClassVar[Format] = "openai_responses"

    def to_job(self, priority: int = 0, strict: bool = False) -> ChatJob:
        b = self.body
        messages = b.messages()
        refused = messages if isinstance(messages, Unsupported) else b.unsupported()
        fmt = (b.text or {}).get("format") or {}
        fields: dict[str, Any] = dict(
            id=self.custom_id,
            type="chat",
            priority=priority,
            messages=messages if refused is None else [ChatMessage(role="user", content="?")],
            max_tokens=b.max_output_tokens,
            json_schema=fmt["schema"] if refused is None and fmt.get("type") == "json_schema"
            else None,
            json_object=fmt.get("type") == "json_object",
            metadata=b.metadata or {},
            unsupported=refused,
            **_sampling(b),
        )  # fmt: skip
        if INCLUDE_LOGPROBS in (b.include or []) or b.top_logprobs is not None:
            fields["logprobs"] = b.top_logprobs or 0
        return ChatJob.model_validate(fields)


class CompletionRequestInput(_RequestLine):
    """One ``/v1/completions`` input line; ``custom_id`` becomes the job id."""

    body: CompletionBody
    format: ClassVar[Format] = "openai_completions"

    def to_job(self, priority: int = 0, strict: bool = False) -> ChatJob:
        b = self.body
        refused = b.unsupported() or (strict_refusal(b) if strict else None)
        fields: dict[str, Any] = dict(
            id=self.custom_id,
            type="chat",
            priority=priority,
            prompt=(b.text() or "?") if refused is None else "?",  # a refused line never runs
            max_tokens=b.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS,
            metadata=b.metadata or {},
            unsupported=refused,
            **_sampling(b),
        )
        if b.logprobs is not None:
            fields["logprobs"] = b.logprobs
        return ChatJob.model_validate(fields)


class BatchRequestInput(_RequestLine):
    """One ``/v1/chat/completions`` input line; ``custom_id`` becomes the job id."""

    body: ChatCompletionBody
    format: ClassVar[Format] = "openai"

    def to_job(self, priority: int = 0, strict: bool = False) -> ChatJob:
        b = self.body
        if strict and (refused := strict_refusal(b)) is not None:
            return _refused_chat(self.custom_id, priority, b.metadata, refused)
        schema = None
        if b.response_format and b.response_format.type == "json_schema":
            spec = b.response_format.json_schema or {}
            if not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
            schema = spec["schema"]
        schema = b.guided_schema() or schema
        json_object = bool(b.response_format and b.response_format.type == "json_object")
        json_object = json_object or bool((b.structured_outputs or {}).get("json_object"))
        fields: dict[str, Any] = dict(
            id=self.custom_id,
            type="chat",
            priority=priority,
            messages=b.messages,
            max_tokens=b.max_completion_tokens or b.max_tokens,
            json_schema=schema,
            json_object=json_object and schema is None,
            metadata=b.metadata or {},
            **_sampling(b),
        )
        if b.logprobs:
            fields["logprobs"] = b.top_logprobs or 0
        tools, refused = _tools(b)
        fields.update(tools)
        fields["unsupported"] = refused or b.unsupported()
        return ChatJob.model_validate(fields)


def _refused_chat(
    custom_id: str, priority: int, metadata: dict[str, Any] | None, refused: Unsupported
) -> ChatJob:
    """A chat request that never runs: the worker fails it with ``refused``, alone."""
    return ChatJob(id=custom_id, type="chat", priority=priority, prompt="?",
                   metadata=metadata or {}, unsupported=refused)  # fmt: skip


class EmbeddingBody(BaseModel):
    """A ``/v1/embeddings`` body: OpenAI's fields, and vLLM's ``truncate_prompt_tokens`` (cut
    each input to its last k tokens; -1: to the model's length). Fields that change nothing
    are ignored and unknown ones refused, as for chat."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # a text, texts, token ids, or lists of token ids; checked in ``to_job``, so that a bad
    # input fails its request alone
    input: Any
    dimensions: int | None = None
    encoding_format: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    def unsupported(self) -> Unsupported | None:
        asks = [
            ("encoding_format", self.encoding_format not in (None, "float", "base64"),
             "writes embeddings as float or base64"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens == 0,
             "takes truncate_prompt_tokens of -1 (the model's length) or at least 1"),
        ]  # fmt: skip
        return _first_refused(asks, self.model_extra)


class EmbeddingRequestInput(_RequestLine):
    """One ``/v1/embeddings`` input line; ``custom_id`` becomes the job id."""

    body: EmbeddingBody
    format: ClassVar[Format] = "openai_embeddings"

    def to_job(self, priority: int = 0, strict: bool = False) -> EmbedJob:
        b = self.body
        refused = b.unsupported() or (strict_refusal(b) if strict else None)
        fields: dict[str, Any] = {"id": self.custom_id, "type": "embed", "priority": priority}
        if refused is None:
            fields.update(input=b.input, dimensions=b.dimensions,
                          encoding_format=b.encoding_format or "float")  # fmt: skip
            if (k := b.truncate_prompt_tokens) is not None:  # vLLM's: keep the last k tokens
                fields.update(truncation="tail", **({"max_input_tokens": k} if k > 0 else {}))
            try:
                return EmbedJob.model_validate(fields)
            except ValidationError as exc:  # OpenAI answers such a request with a 400
                loc = exc.errors()[0]["loc"]
                param = str(loc[0]) if loc else "input"
                message = _first_error(exc) if param != "input" else (
                    f"input: a text (not empty, at most {MAX_TEXT_CHARS:,} characters), a "
                    f"list of at most {MAX_EMBED_INPUTS} of them, or token ids"
                )  # fmt: skip
                refused = Unsupported(param=param, message=message)
        return EmbedJob(id=self.custom_id, type="embed", priority=priority, input="?",
                        unsupported=refused)  # fmt: skip


_TOOLS = TypeAdapter(list[Tool])
_TOOL_CHOICE = TypeAdapter(ToolChoice)


def _tools(body: ChatCompletionBody) -> tuple[dict[str, Any], Unsupported | None]:
    """A chat body's tools as the job's fields, or what is wrong with them: tools that do not
    parse, a ``tool_choice`` that is not one of OpenAI's or names no tool given, fail that
    request alone (OpenAI answers such a request with a 400)."""
    if body.tools is None and body.tool_choice in (None, "none", "auto"):
        return {}, None
    try:
        if not body.tools:
            raise ValueError("tool_choice needs tools")
        tools = _TOOLS.validate_python(body.tools)
    except (ValidationError, ValueError) as exc:
        return {}, Unsupported(param="tools", message=f"tools: {_first_error(exc)}")
    try:
        choice = _TOOL_CHOICE.validate_python(body.tool_choice or "auto")
        if choice not in ("none", "auto"):
            tool_call_schema(tools, choice, body.parallel_tool_calls)  # names a tool given
    except (ValidationError, ValueError) as exc:
        return {}, Unsupported(param="tool_choice", message=f"tool_choice: {_first_error(exc)}")
    return {"tools": tools, "tool_choice": choice,
            "parallel_tool_calls": body.parallel_tool_calls}, None  # fmt: skip


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        e = exc.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        return f"{where}: {e['msg']}" if where else str(e["msg"])
    return str(exc)


RequestLine = (
    BatchRequestInput | CompletionRequestInput | ResponsesRequestInput | EmbeddingRequestInput
)


def request_line(obj: dict[str, Any]) -> RequestLine:
    """An OpenAI batch input line as the request its ``url`` names (a chat request when it names
    none of them, whose error then lists them)."""
    url = obj.get("url")
    if url == "/v1/embeddings":
        return EmbeddingRequestInput.model_validate(obj)
    if url == "/v1/completions":
        return CompletionRequestInput.model_validate(obj)
    if url == "/v1/responses":
        return ResponsesRequestInput.model_validate(obj)
    return BatchRequestInput.model_validate(obj)
