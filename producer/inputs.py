"""Reading JSONL input: each line becomes a job or a numbered, specific error.

A bad line never stops the file: it is reported with its line number and the rest go on.
Lines are vqueue jobs (``{"type": "summarize", ...}``) or OpenAI Batch API requests
(``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}``, or
``/v1/completions`` with a ``prompt``); a file may mix them.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from pydantic import TypeAdapter, ValidationError

from schemas import JOB_TYPES, Job, JobError, JobResult, Timings, request_line
from schemas.jobs import Format

# A line larger than this is refused unread: it cannot be a sane job (texts are capped at 1M chars).
MAX_LINE_BYTES = 8 * 1024 * 1024

_job_adapter: TypeAdapter[Any] = TypeAdapter(Job)


@dataclass
class Parsed:
    line: int
    job: Any = None  # a Job model when the line is good
    # the line's format; a bad line's is its own where it reads as an object (an OpenAI request
    # line holds custom_id), else the file's so far, so that its errors-file line matches
    format: Format = "vqueue"
    known: bool = True  # False: the line did not read far enough to say its format
    model: str | None = None  # OpenAI lines: body.model, echoed back
    error: str | None = None
    custom_id: str | None = None  # the line's id, when one could be read, for the errors file


def rejected_result(batch: str, p: Parsed, ident: str | None, error: str) -> JobResult:
    """A vqueue-format line refused at submit, as the errors file writes it: a failed result,
    the same shape as the batch's jobs that fail at a worker."""
    return JobResult(
        id=ident or f"line-{p.line}",
        batch=batch,
        type=p.job.type if p.job is not None else "unknown",
        status="failed",
        line=p.line,
        timings=Timings(enqueued_at=0.0, finished_at=time.time()),
        error=JobError(type="invalid_job", message=f"line {p.line}: {error}"),
    )


def parse_lines(
    lines: Iterable[bytes],
    default_priority: int | None = None,
    default_system: str | None = None,
    strict: bool = False,
) -> Iterator[Parsed]:
    """Parse raw lines (bytes, so invalid UTF-8 is reported, not raised); skips blank lines.
    ``strict``: OpenAI lines carrying vLLM's own fields fail (``Settings.openai_strict``)."""
    seen: set[str] = set()
    last: Format = "vqueue"
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        p = parse_line(n, raw, default_priority, default_system, strict)
        if not p.known:
            p.format = last
        last = p.format
        if p.job is not None:
            if p.job.id in seen:
                p = Parsed(
                    n, format=p.format, custom_id=p.job.id,
                    error=f"duplicate job id {p.job.id!r} in this batch",
                )  # fmt: skip
            else:
                seen.add(p.job.id)
        yield p


COUNTED_BYTES = 64 << 20  # a file up to this size has its lines counted; a larger one sampled


def expected_lines(path: str) -> int:
    """About how many lines the file holds, before its first job is sent (it sizes the
    batch's done map, ``BatchStore.create``): its newlines counted in a file up to
    ``COUNTED_BYTES``, else scaled up from its first 4 MB with half again as margin, so a file
    of many gigabytes is not read twice before anything runs. Too high costs little; too low
    only loses the compact encoding."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size > COUNTED_BYTES:
            head = fh.read(4 << 20)
            return math.ceil(size / max(len(head), 1) * max(head.count(b"\n"), 1) * 1.5)
        return sum(block.count(b"\n") for block in iter(lambda: fh.read(1 << 20), b"")) + 1


def read_lines(fh: BinaryIO) -> Iterator[bytes]:
    """Lines of ``fh`` with over-long ones cut to a marker, never held whole in memory."""
    while True:
        line = fh.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while True:  # skip the rest of the over-long line
                rest = fh.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
            yield b"\0TOO_LONG"
        else:
            yield line


def parse_line(
    n: int,
    raw: bytes,
    default_priority: int | None = None,
    default_system: str | None = None,
    strict: bool = False,
) -> Parsed:
    """One line as a job, or its error; no line, however hostile, raises out of here."""
    try:
        return _parse_line(n, raw, default_priority, default_system, strict)
    except RecursionError:
        return Parsed(n, error="the line nests too deeply to read", known=False)
    except Exception as exc:  # noqa: BLE001  # a line must never stop the file
        return Parsed(
            n, error=f"could not read the line ({type(exc).__name__}: {exc})"[:500], known=False
        )


def _parse_line(
    n: int, raw: bytes, default_priority: int | None, default_system: str | None, strict: bool
) -> Parsed:
    if raw == b"\0TOO_LONG" or len(raw) > MAX_LINE_BYTES:
        return Parsed(n, error=f"line is longer than {MAX_LINE_BYTES} bytes", known=False)
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        return Parsed(n, error=f"not valid UTF-8 at byte {exc.start}", known=False)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return Parsed(n, error=f"not valid JSON: {exc.msg} (column {exc.colno})", known=False)
    if not isinstance(obj, dict):
        return Parsed(
            n, error=f"a line must be a JSON object, got {type(obj).__name__}", known=False
        )
    ident = obj.get("custom_id", obj.get("id"))
    ident = ident if isinstance(ident, str) else None
    fmt: Format = "openai" if "custom_id" in obj else "vqueue"
    try:
        if "custom_id" in obj:
            req = request_line(obj)
            job = req.to_job(priority=default_priority or 0, strict=strict)
            return Parsed(n, job=job, format=req.format, model=req.body.model, custom_id=ident)
        if default_priority is not None and "priority" not in obj:
            obj["priority"] = default_priority
        if default_system is not None and "system" not in obj:
            obj["system"] = default_system
        if "type" not in obj:
            return Parsed(
                n,
                error=f"missing field 'type' (one of {', '.join(JOB_TYPES)})",
                custom_id=ident,
                format=fmt,
            )
        if obj["type"] not in JOB_TYPES:
            return Parsed(
                n,
                error=f"unknown job type {obj['type']!r} (expected one of {', '.join(JOB_TYPES)})",
                custom_id=ident,
                format=fmt,
            )
        return Parsed(n, job=_job_adapter.validate_python(obj), custom_id=ident)
    except ValidationError as exc:
        return Parsed(n, error=describe(exc), custom_id=ident, format=fmt)
    except ValueError as exc:
        return Parsed(n, error=str(exc), custom_id=ident, format=fmt)


def describe(exc: ValidationError) -> str:
    """Pydantic's errors as one line, ``field.path: message; ...``, without the type tag."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = [str(x) for x in err["loc"] if str(x) not in JOB_TYPES]
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc) or '(line)'}: {msg}")
    return "; ".join(parts)
