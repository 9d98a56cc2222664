"""Reading an answer: a JSON job's output parsed and checked against its schema, tool calls
taken out of a chat answer, which jobs want JSON."""

from __future__ import annotations

import json
import secrets
from typing import Any

import jsonschema

from schemas import (
    ChatJob,
    Choice,
    CodegenJob,
    JobResult,
)
from schemas.jobs import NamedToolChoice
from schemas.results import FunctionCall, ToolCall

from .errors import JobFailed
from .prompts import extract_code
from .structured import (
    ToolCallReader,
)


def _tool_calls(job: ChatJob, reader: ToolCallReader | None, result: JobResult) -> None:
    """Each answer's tool calls, in OpenAI's shape. A forced call's answer is the calls: guided
    decoding held it to ``tool_call_schema`` (a named function's arguments object, or for
    ``required`` an array of ``{"name", "parameters"}``), and it keeps no text. Under ``auto``,
    vLLM's parser (``reader``) finds the calls the answer wrote in the model's own syntax, and
    the text before them stays. ``required`` and ``auto`` end ``tool_calls`` where the answer
    stopped on its own, a named function ``stop``, as OpenAI's (and vLLM's) answers do."""
    named = isinstance(job.tool_choice, NamedToolChoice)
    tools = [t.model_dump(exclude_none=True) for t in job.tools or []]
    answers: list[JobResult | Choice] = [result, *(result.choices or [])]
    for answer in answers:
        text: str | None
        if not job.forces_call():
            assert reader is not None
            text, made = reader.read(answer.text or "", tools)
        elif isinstance(job.tool_choice, NamedToolChoice):
            text, made = None, [(job.tool_choice.name, json.dumps(answer.data))]
        else:
            text, made = None, [(c["name"], json.dumps(c["parameters"])) for c in answer.data]
        if not made:
            continue
        answer.text = text
        answer.tool_calls = [
            ToolCall(id=f"call_{secrets.token_hex(12)}",
                     function=FunctionCall(name=name, arguments=args))
            for name, args in made
        ]  # fmt: skip
        if not named and answer.finish_reason == "stop":
            answer.finish_reason = "tool_calls"


def _schema_of(job: Any) -> dict[str, Any] | None:
    """The schema an extract job (or a chat job from an OpenAI json_schema line) must satisfy."""
    schema: dict[str, Any] | None = field_of(job, "json_schema")
    return schema


def field_of(job: Any, name: str) -> Any:
    """The job's field ``name``, None when its type has no such field. Read from the model's
    fields: ``getattr(job, name, None)`` on a pydantic model without it goes through pydantic's
    ``__getattr__``, which raises and catches an error each time, several times a job."""
    return job.__dict__.get(name)


def _wants_json(job: Any) -> bool:
    return _schema_of(job) is not None or (isinstance(job, ChatJob) and job.json_object)


def _read_output(
    job: Any,
    text: str,
    finish_reason: str | None,
    result: JobResult,
    max_tokens: int = 0,
    cut: int = 0,
) -> None:
    """Check the output against what the job asked for; a failure keeps ``result.text`` (the
    partial or invalid output) for the caller to inspect."""
    if isinstance(job, CodegenJob):
        result.code = extract_code(text)
        return
    schema = _schema_of(job)
    if schema is None and not (isinstance(job, ChatJob) and job.json_object):
        return
    if finish_reason == "repetition":
        raise JobFailed(
            "loop",
            "the model repeated itself in every attempt (a cycle of tokens, "
            f"VQUEUE_LOOP_MIN_REPEATS times in a row); the last attempt's output was "
            f"{len(text)} characters",
        )
    if finish_reason == "length":
        retried = f", and at {cut} tokens the first time" if cut else ""
        raise JobFailed(
            "schema_incomplete",
            f"the JSON was cut off at max_tokens={max_tokens}{retried}; the partial output "
            f"was {len(text)} characters",
        )
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, and ints over 4,300 digits
        raise JobFailed("invalid_json", f"the output is not JSON: {exc}"[:500]) from None
    if schema is not None:
        try:
            # the schema was meta-checked at intake; jsonschema.validate() would check it again
            cls = jsonschema.validators.validator_for(schema)
            cls(schema, format_checker=cls.FORMAT_CHECKER).validate(data)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            raise JobFailed("schema_validation", f"at {where}: {exc.message}") from None
    result.data = data
