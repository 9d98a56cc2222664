"""One job, start to finish: prompt, sampling, generation, checking the output, the result.

Everything that can go wrong with one job ends as a failed ``JobResult`` naming the cause; only
a broken engine or lost Redis escapes as an exception (and then the task is redelivered).
"""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema

from schemas import (
    ChatJob,
    CodegenJob,
    Envelope,
    JobError,
    JobResult,
    Settings,
    Timings,
    Usage,
)

from .engine import EngineError, EngineHost, JobTimeout
from .prompts import build_messages, extract_code

# Below this many tokens of room an answer is useless; refuse rather than return a stub.
MIN_ANSWER_TOKENS = 16


class JobFailed(Exception):
    def __init__(self, type_: str, message: str) -> None:
        super().__init__(message)
        self.type, self.message = type_, message


def run_job(env: Envelope, engine: EngineHost, settings: Settings, worker: str) -> JobResult:
    job = env.job
    started = time.time()
    result = JobResult(
        id=job.id,
        batch=env.batch,
        type=job.type,
        status="completed",
        timings=Timings(enqueued_at=env.enqueued_at, started_at=started),
        worker=worker,
        metadata=job.metadata,
        format=env.format,
        model=env.model or engine.model_name,
        prefix_key=env.prefix_key,
    )
    try:
        prompt = engine.chat_prompt(build_messages(job))
        room = settings.max_model_len - len(prompt)
        if room < MIN_ANSWER_TOKENS:
            raise JobFailed(
                "prompt_too_long",
                f"the prompt is {len(prompt)} tokens; the model's context is "
                f"{settings.max_model_len} and the answer needs at least {MIN_ANSWER_TOKENS}",
            )
        max_tokens = min(job.max_tokens or settings.default_max_tokens(job.type), room)
        gen = engine.generate(prompt, sampling_params(job, max_tokens), job.timeout_s)
        result.text = gen.text
        result.finish_reason = gen.finish_reason
        result.usage = Usage(
            prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens
        )
        result.timings.first_token_at = gen.first_token_at
        _read_output(job, gen.text, gen.finish_reason, result)
    except JobFailed as exc:
        result.status = "failed"
        result.error = JobError(type=exc.type, message=exc.message)
    except EngineError as exc:
        result.status = "failed"
        result.error = JobError(type="engine_error", message=str(exc))
    except JobTimeout as exc:
        result.status = "failed"
        result.error = JobError(type="timeout", message=str(exc))
    result.timings.finished_at = time.time()
    return result


def sampling_params(job: Any, max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    schema = _schema_of(job)
    if schema is not None:
        structured = StructuredOutputsParams(json=schema)
    elif isinstance(job, ChatJob) and job.json_object:
        structured = StructuredOutputsParams(json_object=True)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        seed=job.seed,
        stop=job.stop or None,
        min_tokens=min(job.min_tokens, max_tokens),
        ignore_eos=job.ignore_eos,
        structured_outputs=structured,
        # Only the final output crosses back to the task thread: no per-token work in Python.
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _schema_of(job: Any) -> dict[str, Any] | None:
    """The schema an extract job (or a chat job from an OpenAI json_schema line) must satisfy."""
    schema: dict[str, Any] | None = getattr(job, "json_schema", None)
    return schema


def _read_output(job: Any, text: str, finish_reason: str | None, result: JobResult) -> None:
    if isinstance(job, CodegenJob):
        result.code = extract_code(text)
        return
    schema = _schema_of(job)
    if schema is None and not (isinstance(job, ChatJob) and job.json_object):
        return
    if finish_reason == "length":
        raise JobFailed(
            "schema_incomplete", f"the JSON was cut off at max_tokens ({len(text)} characters)"
        )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobFailed("invalid_json", f"the output is not JSON: {exc}") from None
    if schema is not None:
        try:
            # the schema was meta-checked at intake; jsonschema.validate() would check it again
            jsonschema.validators.validator_for(schema)(schema).validate(data)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
            raise JobFailed("schema_validation", f"at {where}: {exc.message}") from None
    result.data = data
