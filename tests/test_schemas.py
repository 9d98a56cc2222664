"""The contract and input parsing alone: no Redis, no engine."""

from __future__ import annotations

import json
from typing import Any

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
    Settings,
    Timings,
    job_json_schema,
    output_line,
)
from schemas.results import TokenLogprob, TopLogprob

jobs = TypeAdapter(Job)

pytestmark = pytest.mark.unit


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
        # past 64 bits a seed cannot reach vLLM's engine core: refused at the edge
        (line({"type": "summarize", "text": "x", "seed": 2**64}), "seed: Input should be less"),
        (
            line(
                {
                    "custom_id": "s",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "x"}], "seed": -(2**64)},
                }
            ),
            "seed: Input should be greater",
        ),  # fmt: skip
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
                    "url": "/v1/moderations",
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


def _guide_line(custom_id: str, **body: Any) -> bytes:
    """A request line the way OpenAI's batch guide writes them."""
    return line({
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hello"}],
                 "max_completion_tokens": 50, "user": "u-1", "n": 1, "logprobs": False,
                 "store": False, **body},
    })  # fmt: skip


def test_openai_bodies_are_taken_as_openai_writes_them() -> None:
    # Given a guide-style line: n 1, user, logprobs false, penalties and a logit bias
    p = parse_line(1, _guide_line("ok", presence_penalty=0.5, frequency_penalty=-0.5,
                                  logit_bias={"42": -100}, seed=7))  # fmt: skip
    # Then it is a job, with what it asked for and nothing refused
    job = p.job
    assert p.error is None and job.unsupported is None, p.error
    assert (job.max_tokens, job.seed, job.presence_penalty, job.frequency_penalty) == (
        50,
        7,
        0.5,
        -0.5,
    )
    assert job.logit_bias == {42: -100.0}
    assert parse_line(1, _guide_line("n", n=3)).job.n == 3
    assert parse_line(1, _guide_line("l", logprobs=True, top_logprobs=2)).job.logprobs == 2
    assert parse_line(1, _guide_line("l", logprobs=True)).job.logprobs == 0
    assert parse_line(1, _guide_line("l")).job.logprobs is None
    # and each thing vqueue does not do is a job that fails alone, naming its field
    for body, param in [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{}]}, "tools"),
        ({"tool_choice": "required"}, "tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"stream": True}, "stream"),
        ({"frobnicate": 1}, "frobnicate"),
    ]:
        p = parse_line(1, _guide_line("x", **body))
        assert p.error is None and p.job.unsupported.param == param, (body, p.error)
    # When a worker fails one, Then its error-file line is the 400 OpenAI writes
    refused = JobResult(
        id="x", batch="b", type="chat", status="failed", timings=Timings(enqueued_at=1.0),
        error=JobError(type="unsupported_parameter", message="tools: vqueue ...", param="tools"),
    )  # fmt: skip
    out = output_line(refused)
    assert out["error"] is None and out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"]["param"] == "tools"
    assert out["response"]["body"]["error"]["code"] == "unsupported_parameter"


def test_forced_tool_calls_are_a_schema_in_and_tool_calls_out() -> None:
    # Given a line with two tools, one call of them required, no parallel calls
    from openai.types.chat import ChatCompletion

    from schemas.results import FunctionCall, ToolCall

    args = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": args}},
             {"type": "function", "function": {"name": "now"}}]  # fmt: skip
    job = parse_line(1, _guide_line("t", tools=tools, tool_choice="required",
                                    parallel_tool_calls=False)).job  # fmt: skip
    # Then guided decoding holds its answer to one call, named and shaped as vLLM's server does
    assert job.unsupported is None and job.forces_call()
    call = {"name": "weather", "parameters": {"city": "Paris"}}
    jsonschema.validate([call], job.json_schema)
    for wrong in ([], [call, call], [{"name": "weather", "parameters": {}}],
                  [{"name": "other", "parameters": {}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, job.json_schema)
    # and a named function holds it to that function's arguments; auto leaves it text
    named = {"type": "function", "function": {"name": "weather"}}
    assert parse_line(1, _guide_line("t", tools=tools, tool_choice=named)).job.json_schema == args
    auto = parse_line(1, _guide_line("t", tools=tools)).job
    assert auto.json_schema is None and not auto.forces_call() and auto.tools
    # When a worker's result carries the call, Then the output line is OpenAI's, as the SDK reads it
    done = JobResult(
        id="t", batch="b", type="chat", status="completed", data=[call],
        finish_reason="tool_calls", timings=Timings(enqueued_at=1.0), format="openai", model="m",
        tool_calls=[ToolCall(id="call_1", function=FunctionCall(name="weather",
                                                                arguments='{"city": "Paris"}'))],
    )  # fmt: skip
    body = output_line(done)["response"]["body"]
    (choice,) = ChatCompletion.model_validate(body).choices
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "weather"  # type: ignore[index]


def test_a_line_written_for_vllm_run_batch_runs_unchanged() -> None:
    # Given a chat line with vLLM's own request fields, as `vllm run-batch` takes them
    p = parse_line(1, _guide_line("v", min_tokens=8, ignore_eos=True, top_k=20, min_p=0.05,
                                  repetition_penalty=1.1, stop_token_ids=[7]))  # fmt: skip
    # Then it is a job with each of them, nothing refused
    job = p.job
    assert p.error is None and job.unsupported is None, p.error
    assert (job.min_tokens, job.ignore_eos, job.top_k, job.min_p) == (8, True, 20, 0.05)
    assert (job.repetition_penalty, job.stop_token_ids) == (1.1, [7])
    # and vLLM's guided decoding fields are a JSON Schema or a JSON object, as response_format
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert parse_line(1, _guide_line("g", guided_json=schema)).job.json_schema == schema
    so = parse_line(1, _guide_line("s", structured_outputs={"json": json.dumps(schema)})).job
    assert so.json_schema == schema
    assert parse_line(1, _guide_line("o", structured_outputs={"json_object": True})).job.json_object
    # while a kind vqueue does not guide by fails that line alone, naming the field
    regex = parse_line(1, _guide_line("r", structured_outputs={"regex": "a+"})).job
    assert regex.unsupported is not None and regex.unsupported.param == "structured_outputs"
    assert parse_line(1, _guide_line("b", top_k=-2)).error is not None  # out of vLLM's range


def test_strict_refuses_vllms_own_fields_each_request_alone() -> None:
    # Given the same run-batch line read under VQUEUE_OPENAI_STRICT
    raw = _guide_line("v", top_k=20, min_p=0.05)
    p = parse_line(1, raw, strict=True)
    # Then it is a job that fails alone, naming the first such field as OpenAI's API would
    assert p.error is None and p.job.unsupported is not None
    assert p.job.unsupported.param == "top_k"
    assert p.job.unsupported.message == "Unrecognized request argument supplied: top_k"
    # while a line with OpenAI's fields only runs as before
    assert parse_line(1, _guide_line("o", temperature=0.5), strict=True).job.unsupported is None
    guided = _guide_line("g", guided_json={"type": "object"})
    assert parse_line(1, guided, strict=True).job.unsupported.param == "guided_json"


def _embedding_line(cid: str, **body: Any) -> bytes:
    return line({"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": "text-embedding-3-small", **body}})  # fmt: skip


def test_embeddings_lines_are_embed_jobs_and_bad_ones_fail_alone() -> None:
    # Given /v1/embeddings lines as OpenAI's batch guide writes them, and vLLM's token ids
    texts = parse_line(1, _embedding_line("a", input=["x", "y"], encoding_format="base64",
                                          dimensions=256, user="u"))  # fmt: skip
    ids = parse_line(2, _embedding_line("b", input=[[1, 2], [3]]))
    cut = parse_line(3, _embedding_line("c", input="x", truncate_prompt_tokens=5))
    # Then each is an embed job with what it asked, answered in the embeddings format
    job = texts.job
    assert texts.format == "openai_embeddings" and job.type == "embed"
    assert (job.inputs(), job.encoding_format, job.dimensions) == (["x", "y"], "base64", 256)
    assert ids.job.inputs() == [[1, 2], [3]]
    assert parse_line(4, _embedding_line("d", input=[5, 6])).job.inputs() == [[5, 6]]
    # vLLM's truncate_prompt_tokens keeps the last k tokens
    assert (cut.job.truncation, cut.job.max_input_tokens) == ("tail", 5)
    # and what cannot run fails that request alone with a 400 naming the field
    for body, param in (({"input": ""}, "input"), ({"input": ["x"] * 2049}, "input"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "temperature": 0}, "temperature")):  # fmt: skip
        bad = parse_line(5, _embedding_line("e", **body))
        assert bad.error is None and bad.job.unsupported.param == param, (body, bad)
    # A vqueue embed job takes no sampling fields: nothing samples a vector
    refused = parse_line(6, line({"type": "embed", "input": "x", "temperature": 0.5}))
    assert refused.error == "temperature: Extra inputs are not permitted"


def test_embedding_output_lines_are_openais_embeddings_body() -> None:
    r = JobResult(id="e1", batch="b", type="embed", status="completed", model="m",
                  embeddings=[[0.5, -0.5], [1.0, 0.0]], format="openai_embeddings",
                  timings=Timings(enqueued_at=1.0, finished_at=2.0))  # fmt: skip
    r.usage.prompt_tokens = 7
    body = output_line(r)["response"]["body"]
    assert body["object"] == "list" and body["model"] == "m"
    assert body["data"][1] == {"index": 1, "object": "embedding", "embedding": [1.0, 0.0]}
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 7
    wrong = r.model_copy(
        update={
            "status": "failed",
            "embeddings": None,
            "error": JobError(type="wrong_model_kind", message="m"),
        }
    )
    assert output_line(wrong)["response"]["status_code"] == 400


def test_an_embedding_input_is_cut_keeping_its_special_tokens() -> None:
    from worker.embeddings import _cut

    ids = [101, *range(1, 11), 102]  # [CLS] 1..10 [SEP]
    special = {101, 102}
    assert _cut(ids, 6, "head", special) == [101, 1, 2, 3, 4, 102]
    assert _cut(ids, 6, "tail", special) == [101, 7, 8, 9, 10, 102]
    assert _cut(ids, 6, "head_tail", special) == [101, 1, 2, 9, 10, 102]
    assert _cut(list(range(1, 11)), 3, "head", special) == [1, 2, 3]  # no special tokens


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
    assert out["response"]["body"]["choices"][0]["logprobs"] is None
    # a request that asked for logprobs gets them in OpenAI's shape
    top = TopLogprob(token="Paris", logprob=-0.01, bytes=[80, 97, 114, 105, 115])
    lp = TokenLogprob(token="Paris", logprob=-0.01, bytes=top.bytes, top_logprobs=[top])
    choice = output_line(ok.model_copy(update={"logprobs": [lp]}))["response"]["body"]["choices"][0]
    assert choice["logprobs"] == {"refusal": None, "content": [{
        "token": "Paris", "logprob": -0.01, "bytes": [80, 97, 114, 105, 115],
        "top_logprobs": [{"token": "Paris", "logprob": -0.01, "bytes": [80, 97, 114, 105, 115]}],
    }]}  # fmt: skip
    bad = ok.model_copy(
        update={"status": "failed", "error": JobError(type="prompt_too_long", message="m")}
    )
    out = output_line(bad)
    assert out["response"] is None and out["error"]["code"] == "prompt_too_long"


def _completion_line(cid: str, **body: Any) -> bytes:
    line = {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "Q: 2+2?\nA:", **body}}  # fmt: skip
    return json.dumps(line).encode()


def test_completions_lines_are_bare_prompts_answered_as_text_completions() -> None:
    # Given a /v1/completions line as OpenAI's legacy endpoint takes it
    p = parse_line(1, _completion_line("c1", max_tokens=5, logprobs=2, stop="\n", user="u"))
    # Then it is a chat job holding the bare prompt, in the completions form
    job = p.job
    assert p.error is None and p.format == "openai_completions" and job.unsupported is None
    assert (job.prompt, job.messages, job.max_tokens, job.logprobs, job.stop) == (
        "Q: 2+2?\nA:",
        [],
        5,
        2,
        ["\n"],
    )
    # and without max_tokens it gets OpenAI's 16, as vLLM's endpoint gives it
    assert parse_line(1, _completion_line("c2")).job.max_tokens == 16
    # and what vqueue does not do fails that line alone, naming its field
    for body, param in [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"n": 1, "best_of": 3}, "best_of"),
        ({"frobnicate": 1}, "frobnicate"),
    ]:
        p = parse_line(1, _completion_line("x", **body))
        assert p.error is None and p.job.unsupported.param == param, (body, p.error)
    assert parse_line(1, _completion_line("x", prompt=["one"])).job.prompt == "one"
    # and a line for an endpoint vqueue does not take names the four it does
    other = json.loads(_completion_line("x"))
    p = parse_line(1, json.dumps({**other, "url": "/v1/moderations"}).encode())
    assert p.job is None and "'/v1/responses' or '/v1/embeddings'" in p.error, p.error
    # When it completes, Then its output line is a text_completion with legacy logprobs
    top = TopLogprob(token=" 4", logprob=-0.5, bytes=[32, 52])
    done = JobResult(
        id="c1", batch="b", type="chat", status="completed", text=" 4", finish_reason="stop",
        timings=Timings(enqueued_at=1.0, finished_at=2.0), model="m", format="openai_completions",
        logprobs=[TokenLogprob(token=" 4", logprob=-0.5, bytes=[32, 52], top_logprobs=[top])],
    )  # fmt: skip
    body = output_line(done)["response"]["body"]
    assert (body["object"], body["id"], body["model"]) == ("text_completion", "cmpl-c1", "m")
    assert body["choices"] == [{"index": 0, "text": " 4", "finish_reason": "stop", "logprobs": {
        "tokens": [" 4"], "token_logprobs": [-0.5], "top_logprobs": [{" 4": -0.5}],
        "text_offset": [0]}}]  # fmt: skip
    # and a vqueue chat job takes messages or a prompt, not both, not neither
    for wrong in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
                  {"prompt": "a", "system": "s"}):  # fmt: skip
        with pytest.raises(ValidationError):
            jobs.validate_python({"type": "chat", **wrong})


def _responses_line(cid: str, **body: Any) -> bytes:
    line = {"custom_id": cid, "method": "POST", "url": "/v1/responses",
            "body": {"model": "m", "input": "Name a colour.", **body}}  # fmt: skip
    return json.dumps(line).encode()


def test_responses_lines_are_chats_answered_as_response_objects() -> None:
    # Given /v1/responses lines: a string input with instructions, message items with text
    # parts (a developer turn among them), a JSON Schema in text.format, logprobs included
    p = parse_line(1, _responses_line("r1", instructions="Be brief.", max_output_tokens=9,
                                      include=["message.output_text.logprobs"], top_logprobs=2,
                                      store=False))  # fmt: skip
    job = p.job
    assert p.error is None and p.format == "openai_responses" and job.unsupported is None
    assert [(m.role, m.content) for m in job.messages] == [
        ("system", "Be brief."), ("user", "Name a colour.")
    ]  # fmt: skip
    assert (job.max_tokens, job.logprobs) == (9, 2)
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [
                 {"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": " there"}
             ]}]  # fmt: skip
    schema = {"type": "object", "properties": {"c": {"type": "string"}}}
    fmt = {"format": {"type": "json_schema", "name": "c", "schema": schema, "strict": True}}
    job = parse_line(1, _responses_line("r2", input=items, text=fmt)).job
    assert [(m.role, m.content) for m in job.messages] == [
        ("system", "Answer in French."), ("user", "Hello there")
    ]  # fmt: skip
    assert job.json_schema == schema and job.unsupported is None
    # and what vqueue does not do fails that line alone, naming its field
    for body, param in [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"stream": True}, "stream"),
        ({"frobnicate": 1}, "frobnicate"),
    ]:  # fmt: skip
        p = parse_line(1, _responses_line("x", **body))
        assert p.error is None and p.job.unsupported.param == param, (body, p.error)
    # When one completes, and one runs out of tokens, Then each is a response object
    done = JobResult(
        id="r1", batch="b", type="chat", status="completed", text="Blue.", finish_reason="stop",
        timings=Timings(enqueued_at=1.0, finished_at=2.0), model="m", format="openai_responses",
        usage={"prompt_tokens": 7, "completion_tokens": 2},
    )  # fmt: skip
    body = output_line(done)["response"]["body"]
    assert (body["object"], body["id"], body["status"], body["model"]) == (
        "response", "resp_r1", "completed", "m"
    )  # fmt: skip
    (message,) = body["output"]
    assert (message["type"], message["role"], message["status"]) == (
        "message", "assistant", "completed"
    )  # fmt: skip
    assert message["content"] == [{"type": "output_text", "text": "Blue.", "annotations": []}]
    assert (body["usage"]["input_tokens"], body["usage"]["output_tokens"]) == (7, 2)
    cut = output_line(done.model_copy(update={"finish_reason": "length"}))["response"]["body"]
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    # and the body is one the openai SDK reads as its Response
    from openai.types.responses import Response

    assert Response.model_validate(body).output_text == "Blue."


def test_the_readme_lists_every_error_type() -> None:
    # the typed list (schemas.results.ErrorType) and README's table name the same errors
    import re
    from pathlib import Path

    from schemas import ERROR_TYPES

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme[readme.index("| error type | meaning |") :].split("\n\n")[0]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.M))
    assert listed == set(ERROR_TYPES)
    with pytest.raises(ValidationError):
        JobError(type="no_such_error", message="m")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("metadata", {"blob": "m" * 20_000}, "the limit is 16384"),
        ("metadata", json.loads('{"a": ' + "[" * 30 + "]" * 30 + "}"), "more than 16 levels deep"),
        ("stop", ["s" * 257], "at most 256 characters"),
        ("stop", [""], "at least 1 character"),
    ],
)  # fmt: skip
def test_metadata_and_stop_strings_are_bounded(field: str, value: object, expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        jobs.validate_python({"type": "summarize", "text": "x", field: value})


def test_a_line_nested_thousands_deep_is_rejected_alone() -> None:
    nested = b'{"type": "summarize", "text": "x", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    good = line({"id": "ok", "type": "summarize", "text": "x"})
    parsed = list(parse_lines([nested, good]))
    assert parsed[0].error == "the line nests too deeply to read"
    assert parsed[1].job is not None


@pytest.mark.parametrize("name", ["V:done", "a b", "x*", "-lead", "", "é"])
def test_batch_ids_take_a_safe_character_set(name: str) -> None:
    from schemas import Envelope

    job = {"type": "summarize", "text": "x"}
    with pytest.raises(ValidationError, match="batch"):
        Envelope.model_validate({"job": job, "batch": name, "enqueued_at": 0})


def test_a_schema_no_answer_could_fill_is_refused_at_once() -> None:
    # llguidance's check is linear in minItems: 1e8 took 22 s at submit, holding the producer
    import time

    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 100_000_000}
    t0 = time.monotonic()
    with pytest.raises(ValidationError, match="minItems=100000000"):
        ExtractJob(type="extract", text="x", json_schema=schema)
    assert time.monotonic() - t0 < 5


def test_built_in_templates_pass_every_check_a_registered_one_must() -> None:
    # Built-ins are made at import without checks (no child process on import); they must
    # pass the same ones a user's template meets at registration
    from schemas.templates import BUILTIN, Template

    for t in BUILTIN.values():
        assert Template.model_validate(t.model_dump()) == t


def test_stored_templates_are_not_checked_again() -> None:
    # A registered template was checked once, when added: reading it back never matches its
    # examples against its schema (a backtracking pattern made that take minutes, every 10 s)
    from schemas.templates import Template

    evil = {
        "name": "evil", "instruction": "x",
        "json_schema": {"type": "object", "properties": {"c": {"type": "string",
                        "pattern": "^(a+)+$"}}},
        "examples": [{"text": "x", "output": {"c": "a" * 40 + "!"}}],
    }  # fmt: skip
    t = Template.model_validate(evil, context={"stored": True})
    assert Template.model_validate_json(t.model_dump_json(), context={"stored": True}) == t


def test_a_model_answers_to_its_served_names_or_else_to_itself() -> None:
    from schemas import Settings

    # Given no served names, a request may name the model as configured
    assert Settings(_env_file=None, model="org/m").served_names() == ["org/m"]
    # and given some (comma-separated, as vLLM's --served-model-name), those alone, in order:
    # the first is the name results report
    named = Settings(_env_file=None, model="org/m", served_model_name=" m , gpt-4o-mini,")
    assert named.served_names() == ["m", "gpt-4o-mini"]


def test_lora_adapters_read_as_name_and_path_and_bad_lists_are_refused() -> None:
    # Given VQUEUE_LORA_ADAPTERS as an operator writes it
    s = Settings(_env_file=None, served_model_name="base", lora_adapters=" a=/x/a , b=/y ")
    # Then each entry is a name and a path
    assert s.adapters() == {"a": "/x/a", "b": "/y"}
    assert Settings(_env_file=None).adapters() == {}
    # and an entry that is not name=path, a name given twice, or the model's own name, is refused
    for bad in ("a", "=/x", "a=", "a=/x,a=/y", "base=/x"):
        with pytest.raises(ValueError, match="VQUEUE_LORA_ADAPTERS"):
            Settings(_env_file=None, served_model_name="base", lora_adapters=bad).adapters()
