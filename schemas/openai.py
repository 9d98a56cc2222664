"""OpenAI Batch API lines, so existing batch tooling works unchanged.

Input: one ``/v1/chat/completions`` request per line. Output: one line per request in OpenAI's
batch output shape; failures go to the errors file with ``response: null`` and an ``error``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .jobs import MAX_OUTPUT_TOKENS, ChatJob, ChatMessage
from .results import JobResult


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    # {"name": ..., "schema": {...}, "strict": ...} when type is json_schema
    json_schema: dict[str, Any] | None = None


class ChatCompletionBody(BaseModel):
    # unknown sampling fields (n, logit_bias, tools...) are refused rather than silently ignored
    model_config = ConfigDict(extra="forbid")

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


class BatchRequestInput(BaseModel):
    """One input line; ``custom_id`` becomes the job id."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=256)
    method: Literal["POST"]
    url: Literal["/v1/chat/completions"]
    body: ChatCompletionBody

    def to_job(self, priority: int = 0) -> ChatJob:
        b = self.body
        schema = None
        if b.response_format and b.response_format.type == "json_schema":
            spec = b.response_format.json_schema or {}
            if not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
            schema = spec["schema"]
        stop = [b.stop] if isinstance(b.stop, str) else (b.stop or [])
        fields: dict[str, Any] = dict(
            id=self.custom_id,
            type="chat",
            priority=priority,
            messages=b.messages,
            max_tokens=b.max_completion_tokens or b.max_tokens,
            stop=stop,
            seed=b.seed,
            json_schema=schema,
            json_object=bool(b.response_format and b.response_format.type == "json_object"),
            metadata=b.metadata or {},
        )
        if b.temperature is not None:
            fields["temperature"] = b.temperature
        if b.top_p is not None:
            fields["top_p"] = b.top_p
        return ChatJob.model_validate(fields)


def output_line(result: JobResult) -> dict[str, Any]:
    """The OpenAI batch output line for one result (completed or failed)."""
    line_id = f"batch_req_{result.id}"
    if result.status == "failed":
        err = result.error
        return {
            "id": line_id,
            "custom_id": result.id,
            "response": None,
            "error": {"code": err.type if err else "error", "message": err.message if err else ""},
        }
    created = int(result.timings.finished_at or time.time())
    body = {
        "id": f"chatcmpl-{result.id}",
        "object": "chat.completion",
        "created": created,
        "model": result.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": result.usage.prompt_tokens,
            "completion_tokens": result.usage.completion_tokens,
            "total_tokens": result.usage.prompt_tokens + result.usage.completion_tokens,
        },
    }
    return {
        "id": line_id,
        "custom_id": result.id,
        "response": {"status_code": 200, "request_id": result.id, "body": body},
        "error": None,
    }


def rejected_line(custom_id: str | None, line_no: int, message: str) -> dict[str, Any]:
    """The errors-file line for an input line refused at submit time."""
    return {
        "id": f"batch_req_line{line_no}",
        "custom_id": custom_id,
        "response": None,
        "error": {
            "code": "invalid_request",
            "message": f"line {line_no}: {message}",
            "line": line_no,
        },
    }
