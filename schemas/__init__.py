"""The contract between producers and workers: pydantic models only, no I/O."""

from .jobs import (
    JOB_TYPES,
    ChatJob,
    ChatMessage,
    CodegenJob,
    EarlyStopOverride,
    EmbedJob,
    Envelope,
    ExtractJob,
    Job,
    JobType,
    SummarizeJob,
    new_job_id,
)
from .openai import (
    BatchRequestInput,
    CompletionRequestInput,
    EmbeddingRequestInput,
    ResponsesRequestInput,
    request_line,
)
from .openai_output import output_line, rejected_line
from .results import (
    ERROR_TYPES,
    Attempt,
    BatchStatus,
    CanaryReport,
    Choice,
    JobError,
    JobResult,
    Timings,
    Usage,
)
from .settings import EarlyStop, Settings, get_settings

__all__ = [
    "ERROR_TYPES",
    "JOB_TYPES",
    "Attempt",
    "BatchRequestInput",
    "CompletionRequestInput",
    "ResponsesRequestInput",
    "BatchStatus",
    "CanaryReport",
    "ChatJob",
    "ChatMessage",
    "Choice",
    "CodegenJob",
    "EarlyStop",
    "EarlyStopOverride",
    "EmbedJob",
    "EmbeddingRequestInput",
    "Envelope",
    "ExtractJob",
    "Job",
    "JobError",
    "JobResult",
    "JobType",
    "Settings",
    "SummarizeJob",
    "Timings",
    "Usage",
    "get_settings",
    "job_json_schema",
    "new_job_id",
    "output_line",
    "request_line",
    "rejected_line",
]


def job_json_schema() -> dict:
    """JSON Schema of one input line (vqueue job), for producers in other languages."""
    from pydantic import TypeAdapter

    schema = TypeAdapter(Job).json_schema()
    schema["title"] = "vqueue job"
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
