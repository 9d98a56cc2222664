"""The contract and input parsing alone: no Redis, no engine."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import TypeAdapter, ValidationError

from producer.inputs import MAX_LINE_BYTES, parse_line, parse_lines
from schemas import (
    BatchRequestInput,
    ExtractJob,
    Job,
    JobError,
    JobResult,
    Timings,
    job_json_schema,
    output_line,
)

jobs = TypeAdapter(Job)


def line(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_three_job_types_parse_on_their_discriminator() -> None:
    s = jobs.validate_python({"type": "summarize", "text": "hello", "max_words": 10})
    e = jobs.validate_python({"type": "extract", "text": "x", "json_schema": {"type": "object"}})
    c = jobs.validate_python({"type": "codegen", "instruction": "write it", "language": "go"})
    assert (s.type, e.type, c.type) == ("summarize", "extract", "codegen")
    assert s.id and s.id != e.id  # generated when absent
    assert s.temperature == 0.0 and s.priority == 0 and s.metadata == {}


def test_job_schema_export_validates_real_lines() -> None:
    schema = job_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    with open("examples/jobs.jsonl") as fh:
        vqueue_lines = [json.loads(x) for x in fh if '"custom_id"' not in x]
    for obj in vqueue_lines:
        jsonschema.validate(obj, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"type": "summarize"}, schema)  # no text


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b'{"type": "summarize", "text": ', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (line({"type": "translate", "text": "x"}), "unknown job type 'translate'"),
        (line({"text": "x"}), "missing field 'type'"),
        (line({"type": "summarize"}), "text: Field required"),
        (line({"type": "summarize", "text": "x", "max_tokens": "many"}), "max_tokens"),
        (line({"type": "summarize", "text": "x", "colour": "red"}), "colour: Extra inputs"),
        (b'{"type": "summarize", "text": "\xff\xfe"}', "not valid UTF-8"),
        (
            line({"type": "extract", "text": "x", "json_schema": {"type": "objekt"}}),
            "not a valid JSON Schema",
        ),
        (
            line(
                {
                    "type": "extract",
                    "text": "x",
                    "json_schema": {"properties": {"a": {"minimum": "3"}}},
                }
            ),
            "json_schema is not a valid JSON Schema at properties/a/minimum",
        ),
        (
            line(
                {
                    "custom_id": "a",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {"messages": []},
                }
            ),
            "url",
        ),
    ],
)
def test_bad_lines_get_specific_errors(raw: bytes, expected: str) -> None:
    p = parse_line(7, raw)
    assert p.job is None
    assert expected in (p.error or ""), p.error


def test_deep_and_huge_schemas_are_refused_at_submit() -> None:
    deep: dict = {"type": "string"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValidationError, match="levels deep"):
        ExtractJob(type="extract", text="x", json_schema=deep)
    huge = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(ValidationError, match="characters; the limit"):
        ExtractJob(type="extract", text="x", json_schema=huge)


def test_over_long_lines_and_duplicates_and_blank_lines() -> None:
    good = line({"id": "a", "type": "summarize", "text": "x"})
    parsed = list(parse_lines([good, b"\n", good, b"x" * (MAX_LINE_BYTES + 1)]))
    assert [p.line for p in parsed] == [1, 3, 4]
    assert parsed[0].job is not None
    assert "duplicate job id 'a'" in (parsed[1].error or "")
    assert "longer than" in (parsed[2].error or "")


def test_openai_line_maps_to_chat_job_with_schema() -> None:
    raw = {
        "custom_id": "r1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 9,
            "temperature": 0.3,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        },
    }
    p = parse_line(1, line(raw))
    assert p.format == "openai" and p.model == "m"
    job = p.job
    assert (job.id, job.type, job.max_tokens, job.temperature) == ("r1", "chat", 9, 0.3)
    assert job.json_schema == {"type": "object"}
    BatchRequestInput.model_validate(raw)


def test_openai_output_lines_follow_the_batch_output_format() -> None:
    ok = JobResult(
        id="r1",
        batch="b",
        type="chat",
        status="completed",
        text="Paris",
        finish_reason="stop",
        timings=Timings(enqueued_at=1.0, finished_at=2.0),
        model="m",
    )
    out = output_line(ok)
    assert out["custom_id"] == "r1" and out["error"] is None
    assert out["response"]["status_code"] == 200
    assert out["response"]["body"]["choices"][0]["message"]["content"] == "Paris"
    bad = ok.model_copy(
        update={"status": "failed", "error": JobError(type="prompt_too_long", message="m")}
    )
    out = output_line(bad)
    assert out["response"] is None and out["error"]["code"] == "prompt_too_long"
