"""The jobs producers enqueue: one model per job type, discriminated on ``type``.

These models are the wire contract. Producers validate every line before it reaches Redis, so a
worker only ever sees jobs that parse; anything a worker can still reject (a prompt longer than
the model's context) is reported per job as a failed ``JobResult``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import jsonschema
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    from .settings import EarlyStop

# Bounds that keep one hostile line from costing the fleet more than its own failure.
MAX_TESTS_CHARS = 100_000  # a codegen job's tests
MAX_TEXT_CHARS = 1_000_000  # ~250k tokens: larger than any context we serve, still bounded
MAX_SCHEMA_CHARS = 64_000  # a JSON Schema this large is a mistake, and compiling it is costly
MAX_SCHEMA_DEPTH = 32  # grammar compilation recurses; deeper schemas are rejected at submit
MAX_OUTPUT_TOKENS = 32_768  # above any max_model_len we configure by default
MAX_CHOICES = 128  # a chat job's n, OpenAI's own bound
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_TOOLS = 128  # OpenAI's bound on a request's tools
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"  # extraction template names
# Batch ids become Redis keys and the first half of Celery task ids (``batch:job``): no ``:``,
# no spaces or globs, so ``V:done`` can never name another batch's key.
BATCH_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
MAX_METADATA_CHARS = 16_384  # echoed on every result: the caller's bookkeeping, not a payload
MAX_METADATA_DEPTH = 16
MAX_STOP_CHARS = 256  # per stop string; up to 16 of them
# Counts a schema may name: a minimum above any answer's length can never be generated, and
# llguidance's grammar grows with every count, maximums included (maxItems unrolls into rules).
MAX_SCHEMA_COUNT = MAX_OUTPUT_TOKENS
_SCHEMA_COUNTS = (
    *("minItems", "minLength", "minProperties", "minContains"),
    *("maxItems", "maxLength", "maxProperties", "maxContains"),
)


def new_job_id() -> str:
    return uuid.uuid4().hex


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made, as OpenAI's conversations carry it."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: dict[str, str]  # {"name": ..., "arguments": a JSON object as text}


class ChatMessage(BaseModel):
    """One OpenAI-style chat message of plain-text content: a system, user or assistant turn, an
    assistant turn's ``tool_calls`` (its content may be null), or a ``tool`` turn answering one
    (``tool_call_id``)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_TEXT_CHARS)
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _null_content(cls, data: Any) -> Any:
        """An assistant turn that only called tools has ``content: null`` in OpenAI's form."""
        if isinstance(data, dict) and data.get("content") is None and data.get("tool_calls"):
            return {**data, "content": ""}
        return data


class EarlyStopOverride(BaseModel):
    """A job's changes to its type's early-stop policy; fields left out keep the type's value."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = None
    threshold: float | None = Field(default=None, lt=0.0)
    window: int | None = Field(default=None, ge=1, le=64)
    grace_tokens: int | None = Field(default=None, ge=0, le=4096)
    max_retries: int | None = Field(default=None, ge=0, le=5)
    retry_temperature_scale: float | None = Field(default=None, ge=0.0, le=1.0)
    greedy_retry_temperature: float | None = Field(default=None, gt=0.0, le=2.0)
    greedy_last: bool | None = None

    def over(self, policy: EarlyStop) -> EarlyStop:
        changes = self.model_dump(exclude_none=True)
        changes.setdefault("enabled", True)  # naming any setting asks for early stop
        return policy.model_copy(update=changes)


class _Common(BaseModel):
    """What every job has, whatever it asks of the model: who it is, where it goes, how long
    it may take, how its input is bounded, and the caller's bookkeeping."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    id: str = Field(default_factory=new_job_id, min_length=1, max_length=256)
    # 0..9, higher runs first (Redis priority lists in the broker)
    priority: int = Field(default=0, ge=0, le=9)
    # the served model that answers (a name from a worker's VQUEUE_SERVED_MODEL_NAME, else its
    # VQUEUE_MODEL): producers route the job to a live worker serving it; None: any worker
    # of the job's kind (an embedding job: one on a pooling model)
    model: str | None = Field(default=None, min_length=1, max_length=256)
    # fail with "timeout" if still running after this long (capped by VQUEUE_JOB_TIMEOUT_S)
    timeout_s: float | None = Field(default=None, gt=0)
    # the document's token limit and what to do past it; None: the worker's per-type settings
    max_input_tokens: int | None = Field(default=None, ge=1)
    truncation: Literal["head", "tail", "head_tail", "reject"] | None = None
    # false: never answered from the result cache, nor stored in it (worker/cache.py)
    cache: bool = True
    # echoed back untouched on the result: the caller's own bookkeeping
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("metadata")
    @classmethod
    def _metadata_bounded(cls, v: dict[str, Any]) -> dict[str, Any]:
        if _depth(v) > MAX_METADATA_DEPTH:
            raise ValueError(f"metadata nests more than {MAX_METADATA_DEPTH} levels deep")
        size = len(json.dumps(v, ensure_ascii=False))
        if size > MAX_METADATA_CHARS:
            raise ValueError(f"metadata is {size} characters; the limit is {MAX_METADATA_CHARS}")
        return v


class _JobBase(_Common):
    """A job the model answers with text: its sampling, its budget, its system prompt."""

    # None means the per-type default from the worker's settings
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)
    # batch work wants reproducible output, so greedy by default
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # a 64-bit integer, as vLLM's own server bounds it: a larger one cannot be sent to the
    # engine core (msgpack refuses it), and vLLM's frontend keeps the failed request as if it
    # were running
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=16
    )
    # vLLM sampling extras: generate at least min_tokens; keep going past EOS (benchmarks use
    # both to fix output length)
    min_tokens: int = Field(default=0, ge=0, le=MAX_OUTPUT_TOKENS)
    ignore_eos: bool = False
    # more of vLLM's own sampling fields, as its server takes them in a request's body: the k
    # likeliest tokens only (0: all), a floor relative to the likeliest, a penalty on tokens
    # already in prompt or answer (1: none), token ids that end the answer
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(
        default_factory=list, max_length=64
    )
    # OpenAI's (and vLLM's) penalties and logit bias: token id -> bias, ids of the model that
    # answers, at most 300 as OpenAI allows
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: (
        dict[Annotated[int, Field(ge=0, lt=2**31)], Annotated[float, Field(ge=-100, le=100)]] | None
    ) = Field(default=None, max_length=300)
    # None: the worker's per-type system prompt; "": an empty system turn; else this text
    system: str | None = Field(default=None, max_length=20_000)
    # logprob early stop: None: the worker's per-type policy; false: off; true: on with that
    # policy; an object: that policy with these fields changed (EarlyStopOverride)
    early_stop: bool | EarlyStopOverride | None = None


# Whether guided decoding can enforce a schema is llguidance's to say, asked in child processes
# (I/O, which these models do not do): the side that validates jobs as they enter installs that
# check (``producer.grammar_check``, as ``producer`` is imported). Without one, as in a worker,
# which compiles every schema itself, a schema gets only the checks below.
_enforceable: Callable[[str], str | None] | None = None


def set_enforceability_check(check: Callable[[str], str | None] | None) -> None:
    """Install ``check`` (a schema's JSON text -> why it cannot be enforced, or None) for every
    ``json_schema`` validated from now on without the ``CHECKED`` context."""
    global _enforceable
    _enforceable = check


def _check_json_schema(schema: dict[str, Any], grammar: bool = True) -> dict[str, Any]:
    """Reject schemas that are invalid, too large or deep, or that guided decoding cannot
    enforce (``grammar``), naming the problem."""
    text = json.dumps(schema, sort_keys=True)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"json_schema is {len(text)} characters; the limit is {MAX_SCHEMA_CHARS}")
    problem = _schema_problem(text)
    if problem is None and grammar and _enforceable is not None:
        problem = _enforceable(text)
    if problem:
        raise ValueError(problem)
    return schema


# Validation context of a job already checked: producers asked llguidance whether guided
# decoding can enforce its schema (``producer/grammar_check.py``) before it reached Redis, and a
# worker compiles every schema itself and fails what does not compile (worker/structured.py).
CHECKED = {"grammar_checked": True}


def _schema_ok(v: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
    if v is None:
        return None
    return _check_json_schema(v, grammar=not (info.context or {}).get("grammar_checked"))


@functools.lru_cache(maxsize=4096)
def _schema_problem(text: str) -> str | None:
    """What is wrong with a schema on its face, cached by schema text: a batch reuses a few
    schemas thousands of times, and the meta-schema check costs about a millisecond each."""
    schema = json.loads(text)
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        return f"json_schema nests more than {MAX_SCHEMA_DEPTH} levels deep"
    count = _largest_count(schema)
    if count is not None:
        word, value = count
        return (
            f"json_schema asks for {word}={value}; counts in a schema are limited to "
            f"{MAX_SCHEMA_COUNT}, the most tokens an answer can have"
        )
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return f"json_schema is not a valid JSON Schema at {where}: {exc.message}"
    return None


def _largest_count(node: Any, level: int = 0) -> tuple[str, str] | None:
    """The first ``minItems``-like count over ``MAX_SCHEMA_COUNT``, if any."""
    if level > MAX_SCHEMA_DEPTH:
        return None
    if isinstance(node, dict):
        for word in _SCHEMA_COUNTS:
            value = node.get(word)
            if isinstance(value, int | float) and value > MAX_SCHEMA_COUNT:
                return word, f"{value:.0f}" if value < 1e18 else f"{value:g}"
        children: Any = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        found = _largest_count(child, level + 1)
        if found:
            return found
    return None


def _depth(node: Any, level: int = 0) -> int:
    if level > MAX_SCHEMA_DEPTH:  # stop walking: the answer is already "too deep"
        return level
    if isinstance(node, dict):
        return max((_depth(v, level + 1) for v in node.values()), default=level)
    if isinstance(node, list):
        return max((_depth(v, level + 1) for v in node), default=level)
    return level


# a language's name or code: "Chinese", "zh", "pt-BR", "Serbian (Latin)"
LANGUAGE_PATTERN = r"^[A-Za-z][A-Za-z ()-]{1,39}$"


class SummarizeJob(_JobBase):
    """Summarize ``text``; ``max_words`` and ``style`` shape the instruction."""

    type: Literal["summarize"]
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    max_words: int | None = Field(default=None, ge=1, le=5000)
    # free-form: "bullet points", "one sentence", "for a lawyer"...
    style: str | None = Field(default=None, max_length=200)
    # the language to write the summary in ("Chinese", or a code such as "zh"); unset, the
    # document's own where its script names it (worker/prompts.py: answer_language)
    language: str | None = Field(default=None, pattern=LANGUAGE_PATTERN)


class ExtractJob(_JobBase):
    """Extract data from ``text`` as JSON that satisfies ``json_schema`` (guided decoding)."""

    type: Literal["extract"]
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    # the JSON Schema the output must satisfy; may be left out when ``template`` brings one
    json_schema: dict[str, Any] | None = None
    # what to extract, in words; the schema alone is often enough
    instruction: str | None = Field(default=None, max_length=4000)
    # a named extraction template (schemas/templates.py; `vqueue templates list`): its worked
    # examples go into the prompt, and its instruction and schema stand in for missing ones
    template: str | None = Field(default=None, pattern=NAME_PATTERN)
    # the language of free-text values, as for summaries; unset, the document's where its
    # script names it
    language: str | None = Field(default=None, pattern=LANGUAGE_PATTERN)

    _schema_ok = field_validator("json_schema")(_schema_ok)

    @model_validator(mode="after")
    def _needs_schema(self) -> ExtractJob:
        if self.json_schema is None and self.template is None:
            raise ValueError("an extract job needs a json_schema or a template")
        return self


PYTHON = ("python", "python3", "py")  # the language names tests run for


class CodegenJob(_JobBase):
    """Write code in ``language`` following ``instruction``, optionally against ``context`` code.
    With ``tests`` (Python), the answer runs against them in a sandbox and is sampled again
    until it passes, at most ``max_attempts`` times (``worker/sandbox.py``)."""

    type: Literal["codegen"]
    instruction: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    language: str = Field(default="python", min_length=1, max_length=40)
    context: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    # code that checks the answer: asserts after it (the answer is also ``import solution``),
    # or HumanEval's ``def check(candidate)`` called with ``entry_point``
    tests: str | None = Field(default=None, min_length=1, max_length=MAX_TESTS_CHARS)
    entry_point: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,99}$")
    max_attempts: int = Field(default=3, ge=1, le=10)

    @model_validator(mode="after")
    def _tests_run_for_python(self) -> CodegenJob:
        if self.tests is not None and self.language.lower() not in PYTHON:
            raise ValueError(f"tests run for Python answers only, not {self.language[:40]!r}")
        if self.entry_point is not None and self.tests is None:
            raise ValueError("entry_point names what the tests' check() is called with: "
                             "it needs tests")  # fmt: skip
        return self


class Unsupported(BaseModel):
    param: str  # the body's field, as OpenAI names it
    message: str


class FunctionSpec(BaseModel):
    """A function the model may call, as OpenAI's ``tools`` describe it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=MAX_SCHEMA_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # taken: the arguments are always enforced by guided decoding


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}

    @property
    def name(self) -> str:
        return self.function.get("name", "")


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _arguments_schema(spec: FunctionSpec) -> dict[str, Any]:
    """A function's arguments schema; a function without one takes an object (as vLLM's)."""
    return spec.parameters or {"type": "object", "properties": {}}


def tool_call_schema(
    tools: list[Tool], choice: ToolChoice, parallel: bool | None
) -> dict[str, Any]:
    """What guided decoding holds an answer to when ``choice`` forces a call, built as vLLM's
    server builds it (``get_json_schema_from_tools``): a named function, its arguments object;
    ``required``, an array of one or more ``{"name", "parameters"}`` calls of the tools given (one
    at most when ``parallel_tool_calls`` is false), their ``$defs`` lifted to the top."""
    if isinstance(choice, NamedToolChoice):
        spec = next((t.function for t in tools if t.function.name == choice.name), None)
        if spec is None:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        return _arguments_schema(spec)
    defs: dict[str, Any] = {}
    calls = []
    for t in tools:
        params = dict(_arguments_schema(t.function))
        for name, sub in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(name, sub) != sub:
                raise ValueError(f"tools define $defs/{name} twice, differently")
        calls.append({
            "properties": {"name": {"type": "string", "enum": [t.function.name]},
                           "parameters": params},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": calls}}  # fmt: skip
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class ChatJob(_JobBase):
    """Raw chat messages, the path OpenAI Batch API lines take; ``json_schema`` when the line
    asked for ``response_format: json_schema``, ``json_object`` for ``response_format:
    json_object``. Or, for a ``/v1/completions`` line, a bare ``prompt``: its text tokenized as
    vLLM's completions endpoint does (special tokens read as such), no chat template."""

    type: Literal["chat"]
    messages: list[ChatMessage] = Field(default_factory=list, max_length=256)
    prompt: str | None = Field(default=None, min_length=1, max_length=MAX_TEXT_CHARS)
    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    # answers to the same messages, each its own request in the engine (``seed`` + k for the
    # k-th when a seed is set): OpenAI's ``n``; the result carries them in ``choices``
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    # OpenAI's logprobs: true with top_logprobs k (0-20): each answer token's log probability
    # and the k likeliest at its place, in the result's ``logprobs``
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # an OpenAI line whose body asks for what vqueue does not do: the job is queued like any
    # other and the worker fails it at once with this (``unsupported_parameter``), so the
    # request fails alone and the batch goes on, as OpenAI answers such a request with a 400
    unsupported: Unsupported | None = None
    # OpenAI's tools: given to the model's chat template, as vLLM's server gives them. A
    # ``tool_choice`` of ``required`` or a named function holds the answer to calls of them by
    # guided decoding (``json_schema``, built here as ``tool_call_schema``), and the result
    # carries ``tool_calls``; ``auto`` (the default with tools) and ``none`` answer text.
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    _schema_ok = field_validator("json_schema")(_schema_ok)

    @model_validator(mode="before")
    @classmethod
    def _tool_schema(cls, data: Any) -> Any:
        """A forced tool call becomes the schema guided decoding holds the answer to, checked
        as any ``json_schema`` is (bounds, meta-schema, enforceability)."""
        if not isinstance(data, dict) or data.get("tool_choice") in (None, "none", "auto"):
            return data
        if not data.get("tools"):
            raise ValueError("tool_choice needs tools")
        tools = [Tool.model_validate(t) for t in data["tools"]]
        choice = data["tool_choice"]
        if not isinstance(choice, str):
            choice = NamedToolChoice.model_validate(choice)
        elif choice != "required":
            return data  # the field's own check names the bad value
        schema = tool_call_schema(tools, choice, data.get("parallel_tool_calls"))
        # a job read back from the queue carries the schema built when it was first validated
        if data.get("json_schema") not in (None, schema) or data.get("json_object"):
            raise ValueError("a forced tool call and response_format cannot be asked together")
        return {**data, "json_schema": schema}

    def forces_call(self) -> bool:
        """Whether the answer must be tool calls (``required`` or a named function)."""
        return self.tool_choice is not None and self.tool_choice not in ("none", "auto")

    @model_validator(mode="after")
    def _messages_or_prompt(self) -> ChatJob:
        if (self.prompt is None) == (not self.messages):
            raise ValueError("a chat job takes either messages (at least one) or a prompt")
        if self.prompt is not None and self.system is not None:
            raise ValueError("system applies to messages; a prompt is taken as it stands")
        return self


MAX_EMBED_INPUTS = 2048  # texts in one embedding request, OpenAI's bound
MAX_EMBED_DIMENSIONS = 65536


class EmbedJob(_Common):
    """Embed ``input`` (a text, or a list of texts, or token ids as vLLM's server takes them)
    with a worker on a pooling model: one vector per text, pooled and normalized as the model's
    own pooling config says. ``dimensions`` cuts each vector to its first so many (Matryoshka
    models only, as vLLM allows); ``base64``: each vector as little-endian float32 bytes in
    base64, as OpenAI's ``encoding_format`` gives them. A text over the model's length follows
    ``truncation`` (by default the worker's ``VQUEUE_TRUNCATION_EMBED``)."""

    type: Literal["embed"]
    input: (
        Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
        | list[Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]]
        | list[Annotated[int, Field(ge=0, lt=2**31)]]
        | list[list[Annotated[int, Field(ge=0, lt=2**31)]]]
    ) = Field(min_length=1)
    dimensions: int | None = Field(default=None, ge=1, le=MAX_EMBED_DIMENSIONS)
    encoding_format: Literal["float", "base64"] = "float"
    # an OpenAI line asking for what vqueue does not do: failed alone by the worker, as for chat
    unsupported: Unsupported | None = None

    @field_validator("input")
    @classmethod
    def _bounded(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_EMBED_INPUTS:
            raise ValueError(f"{len(v)} inputs; one request takes at most {MAX_EMBED_INPUTS}")
        if isinstance(v, list) and any(isinstance(x, list) and not x for x in v):
            raise ValueError("an input of token ids is empty")
        return v

    def inputs(self) -> list[str | list[int]]:
        """Each input on its own: a text, or one text's token ids."""
        v = self.input
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            return [v]  # type: ignore[list-item]
        return list(v)  # type: ignore[arg-type]


# The characters of a bare prompt that its prefix key covers: prompts that open with the same
# preamble (instructions, few-shot examples) go to one engine and share its cached blocks
PROMPT_PREFIX_CHARS = 256


Format = Literal["vqueue", "openai", "openai_completions", "openai_responses", "openai_embeddings"]

AnyJob = SummarizeJob | ExtractJob | CodegenJob | ChatJob | EmbedJob
Job = Annotated[AnyJob, Field(discriminator="type")]
JobType = Literal["summarize", "extract", "codegen", "chat", "embed"]
JOB_TYPES: tuple[str, ...] = ("summarize", "extract", "codegen", "chat", "embed")
# the job types a generating model answers; ``embed`` alone needs a pooling model
GENERATE_TYPES: tuple[str, ...] = ("summarize", "extract", "codegen", "chat")


def prefix_key(job: AnyJob) -> str:
    """A short hash of the part of a job's prompt that other jobs can share, without a tokenizer.

    It follows the order ``worker/prompts.py`` renders a job in: the system prompt, then the
    per-type head of the user turn (the summary instruction; the extraction instruction and
    schema; the code context), then the job's own text. Jobs with equal keys start with the same
    tokens, so once one of them is prefilled the rest hit vLLM's prefix cache.
    """
    if isinstance(job, SummarizeJob):
        parts: list[Any] = [job.type, job.system, job.max_words, job.style]
    elif isinstance(job, ExtractJob):
        schema = _schema_text(job.json_schema) if job.json_schema is not None else None
        parts = [job.type, job.system, job.template, job.instruction, schema]
    elif isinstance(job, CodegenJob):
        parts = [job.type, job.system, job.language, job.context]
    elif isinstance(job, EmbedJob):  # no prefix to share: spread over the pooling workers
        parts = [job.type, job.id]
    elif job.prompt is not None:
        parts = [job.type, "prompt", job.prompt[:PROMPT_PREFIX_CHARS]]
    else:  # everything before the last message
        parts = [job.type, job.system, [(m.role, m.content) for m in job.messages[:-1]]]
    raw = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()


def _schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"))


class Envelope(BaseModel):
    """What travels in the Celery message: the job plus the bookkeeping the producer adds."""

    model_config = ConfigDict(extra="forbid")

    job: Job
    batch: str = Field(pattern=BATCH_PATTERN)
    # the form the line came in, and its result goes back out in: vqueue's own, an OpenAI Batch
    # API ``/v1/chat/completions`` line ("openai"), a ``/v1/completions`` or ``/v1/responses`` line
    format: Format = "vqueue"
    # the model asked for (an OpenAI request's "model" field, else the job's); routed by, and
    # checked by the worker; the result names the model that answered
    model: str | None = None
    enqueued_at: float
    # jobs with one key share a prompt prefix (``prefix_key``); filled in when not given
    prefix_key: str | None = Field(default=None, max_length=64)
    # whose job: the engine caches its prompt's prefix for this tenant alone (vLLM's cache_salt)
    tenant: str | None = Field(default=None, max_length=128)
    # false: the whole batch bypasses the result cache (``vqueue submit --no-cache``)
    cache: bool = True
    # the job's line in the input file its batch is fed from: such a job is known by its place
    # (a bit once done, ``protocol.store``), so Redis keeps no per-job mark of a fed batch
    line: int | None = Field(default=None, ge=1)
    _wire: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _fill_prefix_key(self) -> Envelope:
        if self.prefix_key is None:
            self.prefix_key = prefix_key(self.job)
        if self.model is None:
            self.model = self.job.model
        return self

    def wire(self) -> str:
        """The envelope as it travels (JSON), serialized once: the producer both counts its
        size and sends it. Fields at their default stay out: validation on the worker's side
        puts them back, and a job's message is decoded three times on the way (kombu's read,
        Celery's protocol check, the task) and copied whole into the unacknowledged hash, so
        it costs what it sets, not every field the job types have. Its cache is read from the
        private values' own dict: ``self._wire`` goes through pydantic's ``__getattr__``, far
        slower, and a producer asks a few times a job."""
        private = self.__pydantic_private__
        assert private is not None  # the model has a private attribute: pydantic sets the dict
        wire: str | None = private["_wire"]
        if wire is None:
            wire = private["_wire"] = self.model_dump_json(exclude_defaults=True)
        return wire
