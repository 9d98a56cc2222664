"""The objects of vqueue's HTTP API (``vqueue serve``): OpenAI's Files and Batches, field for
field, so the official ``openai`` SDK parses every response. vqueue's own job lines go through
the same API under the endpoint ``/v1/vqueue/jobs`` (docs/http-api.md)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from .jobs import Format
from .results import CanaryReport

# What a batch's input file holds: OpenAI chat, completions, responses or embeddings requests, or
# vqueue's own job lines (every type, extraction schemas and templates included); a batch takes
# lines of its endpoint only, and each endpoint's lines come back in their own form.
Endpoint = Literal[
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/vqueue/jobs"
]
ENDPOINT_FORMAT: dict[str, Format] = {
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai_completions",
    "/v1/embeddings": "openai_embeddings",
    "/v1/responses": "openai_responses",
    "/v1/vqueue/jobs": "vqueue",
}
ENDPOINTS = tuple(ENDPOINT_FORMAT)

BatchState = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
# a batch in one of these never changes again
FINAL_STATES = ("failed", "completed", "expired", "cancelled")

FilePurpose = Literal["batch", "batch_output"]

_WINDOW = re.compile(r"^(\d{1,7})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400  # a batch's results are kept a week (VQUEUE_RESULT_TTL_S)
# OpenAI's limits on a batch's metadata
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def window_seconds(window: str) -> int:
    """``completion_window`` in seconds: ``24h`` (OpenAI's only value), or any ``<n>s|m|h|d``
    up to 7 days."""
    m = _WINDOW.match(window)
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"completion_window must look like 24h, 30m or 90s, not {window[:40]!r}")
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds > MAX_WINDOW_S:
        raise ValueError(f"completion_window is at most 7d, not {window!r}")
    return seconds


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class ModelObject(BaseModel):
    """``GET /v1/models``: a model some live worker serves."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vqueue"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy for a file: ``seconds`` after its creation, 1 hour to 30
    days."""

    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(ge=3600, le=30 * 24 * 3600)


class BatchCreate(BaseModel):
    """``POST /v1/batches``."""

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: Endpoint
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_KEYS)
    output_expires_after: ExpiresAfter | None = None  # else VQUEUE_API_OUTPUT_TTL_S

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (v or {}).items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters")
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"metadata values are at most {MAX_METADATA_VALUE_CHARS} characters "
                    f"({key[:64]!r} has {len(value)})"
                )
        return v

    @field_validator("completion_window")
    @classmethod
    def _window(cls, v: str) -> str:
        window_seconds(v)
        return v


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(BaseModel):
    """Tokens of the batch's finished requests, as OpenAI's batch object reports them (what
    the prefix cache served is not told: it would say what other requests held)."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchState
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    model: str | None = None  # the model that answered its requests
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None
    # vqueue's: the canary's report (metadata "canary"); paused: it failed, and the rest of the
    # input waits for `vqueue resume` or a cancel
    canary: CanaryReport | None = None
    paused: bool = False


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ApiError(BaseModel):
    """OpenAI's error body: ``{"error": {...}}``; the SDK raises its typed errors from it."""

    error: dict[str, Any]
