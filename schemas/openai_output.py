"""OpenAI Batch API output lines: one line per request in OpenAI's batch output shape
(``chat.completion``, ``text_completion``, ``response`` or an embeddings ``list``); failures
go to the errors file with ``response: null`` and an ``error``, and a request refused before
it ran carries the status OpenAI's server answers it with."""

from __future__ import annotations

import time
from typing import Any

from .results import Choice, JobResult, TokenLogprob

# Requests refused before they run, and the HTTP status their output line carries
REFUSED_STATUS = {"unsupported_parameter": 400, "model_not_found": 404, "wrong_model_kind": 400}


def output_line(result: JobResult) -> dict[str, Any]:
    """The OpenAI batch output line for one result (completed or failed)."""
    line_id = f"batch_req_{result.id}"
    refused = result.error
    status = REFUSED_STATUS
    if refused and refused.type in status:  # the request's own answer, as OpenAI writes it
        error = {"message": refused.message, "type": "invalid_request_error",
                 "param": refused.param, "code": refused.type}  # fmt: skip
        return {
            "id": line_id,
            "custom_id": result.id,
            "response": {
                "status_code": status[refused.type],
                "request_id": result.id,
                "body": {"error": error},
            },
            "error": None,
        }
    if result.status == "failed":
        err = result.error
        return {
            "id": line_id,
            "custom_id": result.id,
            "response": None,
            "error": {"code": err.type if err else "error", "message": err.message if err else ""},
        }
    created = int(result.timings.finished_at or time.time())
    if result.format == "openai_embeddings":
        return _ok(result, embedding_body(result, created))
    choices = result.choices or [
        Choice(index=0, text=result.text, finish_reason=result.finish_reason,
               logprobs=result.logprobs, tool_calls=result.tool_calls)
    ]  # fmt: skip
    usage = {
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": result.usage.completion_tokens,
        "total_tokens": result.usage.prompt_tokens + result.usage.completion_tokens,
    }
    if result.format == "openai_responses":
        return _ok(result, _response_body(result, created))
    if result.format == "openai_completions":
        body: dict[str, Any] = {
            "id": f"cmpl-{result.id}",
            "object": "text_completion",
            "created": created,
            "model": result.model,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": _legacy_logprobs(c.logprobs),
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],  # fmt: skip
            "usage": usage,
        }
        return _ok(result, body)
    body = {
        "id": f"chatcmpl-{result.id}",
        "object": "chat.completion",
        "created": created,
        "model": result.model,
        "choices": [
            {
                "index": c.index,
                "message": _message(c),
                "logprobs": _logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage,
    }
    return _ok(result, body)


def embedding_body(result: JobResult, created: int) -> dict[str, Any]:
    """A ``/v1/embeddings`` answer, as vLLM's server writes it (OpenAI's fields, and its own
    ``id`` and ``created``): a vector per input, in order."""
    n = result.usage.prompt_tokens
    return {
        "id": f"embd-{result.id}",
        "object": "list",
        "created": created,
        "model": result.model,
        "data": [
            {"index": i, "object": "embedding", "embedding": v}
            for i, v in enumerate(result.embeddings or [])
        ],
        "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    }  # fmt: skip


def _message(choice: Choice) -> dict[str, Any]:
    """A chat answer's message: its text, and its tool calls when it made any (a forced call's
    answer has no text: ``content`` null, as OpenAI's)."""
    if choice.tool_calls is None:
        return {"role": "assistant", "content": choice.text}
    calls = [c.model_dump() for c in choice.tool_calls]
    return {"role": "assistant", "content": choice.text or None, "tool_calls": calls}


def _logprobs(tokens: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's ``logprobs`` as OpenAI writes it; None when the request did not ask."""
    if tokens is None:
        return None
    return {"content": [t.model_dump() for t in tokens], "refusal": None}


def _ok(result: JobResult, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{result.id}",
        "custom_id": result.id,
        "response": {"status_code": 200, "request_id": result.id, "body": body},
        "error": None,
    }


def _response_body(result: JobResult, created: int) -> dict[str, Any]:
    """A ``/v1/responses`` answer: one assistant message of ``output_text``; ``incomplete``
    with its reason when the answer ran out of ``max_output_tokens``."""
    cut = result.finish_reason == "length"
    text: dict[str, Any] = {"type": "output_text", "text": result.text or "", "annotations": []}
    if result.logprobs is not None:
        text["logprobs"] = [t.model_dump() for t in result.logprobs]
    u = result.usage
    return {
        "id": f"resp_{result.id}",
        "object": "response",
        "created_at": created,
        "status": "incomplete" if cut else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": result.model,
        "output": [{
            "type": "message", "id": f"msg_{result.id}", "role": "assistant",
            "status": "incomplete" if cut else "completed", "content": [text],
        }],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "metadata": result.metadata or {},
        "usage": {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        },
    }  # fmt: skip


def _legacy_logprobs(tokens: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A completion choice's ``logprobs`` in the legacy form OpenAI's and vLLM's completions
    write: parallel lists of tokens, their logprobs, the likeliest alternatives at each place
    and each token's character offset in the answer."""
    if tokens is None:
        return None
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs} for t in tokens],
        "text_offset": offsets,
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
