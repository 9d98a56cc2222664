"""What a worker reports for each job; one ``JobResult`` per job, completed or failed."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

# Error types a result may carry. Each names one cause, so callers can branch on it.
ERROR_TYPES = {
    "prompt_too_long": "the prompt does not fit the model's context with room to answer",
    "input_too_long": "the document is over its type's input limit and truncation is 'reject'",
    "schema_validation": "the output did not satisfy the job's JSON Schema",
    "schema_incomplete": "the JSON output was cut off at max_tokens",
    "invalid_json": "the output is not JSON",
    "engine_error": "the engine rejected or failed the request",
    "invalid_job": "the worker could not read the job",
    "timeout": "the job was still generating after VQUEUE_JOB_TIMEOUT_S and was aborted",
    "dead_letter": "its worker was lost every time it ran; parked in the dead-letter store",
}


class JobError(BaseModel):
    type: str  # one of ERROR_TYPES, or "invalid_input" for lines the producer rejected
    message: str


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache


class Timings(BaseModel):
    """Wall-clock epoch seconds; ``first_token_at`` is None where the engine did not report it."""

    enqueued_at: float
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class JobResult(BaseModel):
    id: str
    batch: str
    type: str
    status: Literal["completed", "failed"]
    text: str | None = None  # the model's whole output
    data: Any = None  # extract (and chat with a schema): the parsed JSON
    code: str | None = None  # codegen: the code block pulled out of text
    finish_reason: str | None = None  # "stop" or "length", as vLLM reports it
    usage: Usage = Field(default_factory=Usage)
    timings: Timings
    worker: str | None = None
    error: JobError | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    format: Literal["vqueue", "openai"] = "vqueue"
    model: str | None = None  # the model that served the job
    prefix_key: str | None = None  # the job's shared-prefix group (schemas.jobs.prefix_key)
    input_chars_cleaned: int = 0  # invisible/control characters and styling removed
    input_tokens_truncated: int = 0  # document tokens cut by the truncation policy


class BatchStatus(BaseModel):
    """Counters for one batch, as ``vqueue status BATCH`` reports them."""

    batch: str
    total: int  # jobs enqueued
    completed: int
    failed: int
    rejected: int  # input lines refused at submit; never enqueued
    created_at: float
    updated_at: float | None = None
    prompt_tokens: int = 0  # of finished jobs
    cached_tokens: int = 0  # of those, served from the prefix cache

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def remaining(self) -> int:
        return max(self.total - self.done, 0)
