"""End to end on the real parts: Redis, a ``vqueue worker`` process, vLLM, SmolLM2-135M."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
import uuid
from pathlib import Path

import jsonschema
import pytest
import redis

from producer import AsyncClient, BatchNotFound, Client, WaitTimeout
from schemas import CodegenJob, ExtractJob, SummarizeJob

from .conftest import WorkerProc, make_settings, require, run_cli, wait_for

pytestmark = pytest.mark.engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_three_job_types_complete(worker: WorkerProc, client: Client) -> None:
    # Given one job of each type
    jobs = [
        SummarizeJob(
            type="summarize",
            id="s",
            max_words=20,
            max_tokens=48,
            text="The river flooded the valley after a week of rain. Farmers moved "
            "their animals to the hills and the town opened a shelter in the school.",
        ),
        ExtractJob(
            type="extract",
            id="e",
            max_tokens=64,
            json_schema=PERSON,
            text="Tom Baker, 52, lives in Leeds and teaches history.",
        ),
        CodegenJob(
            type="codegen",
            id="c",
            max_tokens=96,
            metadata={"ticket": 17},
            instruction="Write a Python function add(a, b) that returns a + b.",
        ),
    ]
    # When they go through the queue
    batch = client.submit_many(jobs)
    results = {r.id: r for r in batch.results(timeout=300)}
    # Then all three complete, with their type's output and full bookkeeping
    assert {r.status for r in results.values()} == {"completed"}, results
    s, e, c = results["s"], results["e"], results["c"]
    assert s.text and s.finish_reason in ("stop", "length")
    jsonschema.validate(e.data, PERSON)
    assert json.loads(e.text or "") == e.data
    assert c.code and "def add" in c.code and "```" not in c.code
    assert c.metadata == {"ticket": 17}
    for r in results.values():
        assert r.worker == worker.node and r.batch == batch.id
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
        t = r.timings  # queued, prompt built, into vLLM, its queue, prefill, generating
        stamps = [t.enqueued_at, t.started_at, t.sent_at, t.submitted_at, t.scheduled_at,
                  t.first_token_at, t.finished_at]  # fmt: skip
        assert None not in stamps and stamps == sorted(stamps), stamps
    st = batch.status()
    assert (st.total, st.completed, st.failed) == (3, 3, 0)


def _counters(port: int, name: str) -> dict[str, float]:
    """The worker's ``name`` counter by its label set, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = (re.match(rf"^{name}(\{{[^}}]*\}}) ([0-9.e+-]+)$", x) for x in text.splitlines())
    return {m.group(1): float(m.group(2)) for m in found if m}


def test_codegen_answers_run_against_their_tests_until_one_passes(
    client: Client, worker: WorkerProc
) -> None:
    require("bwrap")  # the worker runs the tests in its sandbox
    require("prlimit")
    before = _counters(worker.metrics_port, "vqueue_codegen_tested_total")
    # Given a codegen job whose tests a right answer passes, and one whose tests none can
    instruction = "Write a Python function add(a, b) that returns a + b."
    right = CodegenJob(
        type="codegen",
        id="cg-right",
        instruction=instruction,
        max_tokens=96,
        tests="assert add(2, 3) == 5\nassert add(-1, 1) == 0",
        max_attempts=4,
    )
    impossible = "assert False, 'no answer passes this'"
    never = CodegenJob(
        type="codegen",
        id="cg-never",
        instruction=instruction,
        max_tokens=96,
        tests=impossible,
        max_attempts=2,
        seed=5,
    )
    # When they go through the queue
    results = {r.id: r for r in client.submit_many([right, never]).results(timeout=300)}
    # Then the first completes with an answer that passed, every run of its tests recorded
    ok = results["cg-right"]
    assert ok.status == "completed" and ok.tests is not None and ok.tests.passed, ok
    assert ok.tests.attempts[-1].outcome == "passed" and "def add" in (ok.code or ""), ok
    assert all(a.outcome != "passed" for a in ok.tests.attempts[:-1]), ok.tests
    # and the other fails tests_failed after its two attempts, each with the failing line, the
    # retry sampled with a new seed, the first answer's tokens counted as wasted
    bad = results["cg-never"]
    assert bad.status == "failed" and bad.error and bad.error.type == "tests_failed", bad
    runs = bad.tests.attempts if bad.tests else []
    assert [(a.n, a.outcome, a.detail) for a in runs] == [
        (1, "failed", f"AssertionError: no answer passes this in `{impossible}`"),
        (2, "failed", f"AssertionError: no answer passes this in `{impossible}`"),
    ], runs
    assert (runs[0].seed, runs[1].seed, runs[1].temperature) == (5, 6, 0.8), runs
    # and the worker's metrics count them for pass@1 and pass@k
    first = ok.tests.attempts[0].outcome == "passed"
    want = {
        '{outcome="first"}': float(first),
        '{outcome="retried"}': float(not first),
        '{outcome="failed"}': 1.0,
    }

    def deltas() -> dict[str, float]:
        now = _counters(worker.metrics_port, "vqueue_codegen_tested_total")
        return {k: now.get(k, 0.0) - before.get(k, 0.0) for k in want}

    wait_for(lambda: deltas() == want, 15, f"the metrics to count the tested jobs: {want}")
    assert bad.usage.wasted_tokens == runs[0].tokens > 0 and bad.code is not None, bad.usage


def test_jobs_run_concurrently_in_one_engine(worker: WorkerProc, client: Client) -> None:
    # Given eight jobs submitted at once to one worker (one engine of 8 sequences)
    jobs = [
        SummarizeJob(
            type="summarize",
            id=f"j{i}",
            max_tokens=64,
            min_tokens=64,
            ignore_eos=True,
            text=f"Item {i}: the shop sold {i * 3} lamps and {i + 2} chairs on Monday.",
        )
        for i in range(8)
    ]
    batch = client.submit_many(jobs)
    # When they run, the engine's own gauge of running requests is read as they go
    seen: list[float] = []

    def finished() -> bool:
        seen.append(_gauge(worker.metrics_port, "vqueue_engine_running_requests"))
        st = batch.status()
        return st.done >= st.total

    wait_for(finished, 300, "the eight jobs", interval=0.1)
    results = list(batch.results(timeout=60))
    assert len(results) == 8 and all(r.status == "completed" for r in results)
    # Then the engine held them all at once (continuous batching) instead of one after another
    assert max(seen) >= 6, seen
    assert {r.worker for r in results} == {worker.node}


def test_jobs_packed_to_a_message_each_run_once_and_a_redelivered_pack_runs_none_again(
    worker: WorkerProc, redis_client: redis.Redis
) -> None:
    # Given ten jobs submitted four to a message, to a queue no worker takes from, with one
    # already submitted alone before
    from protocol.wire import queue_keys

    held = f"{worker.queue}-held-{uuid.uuid4().hex[:6]}"
    packing = Client(make_settings(held, jobs_per_message=4))
    jobs = [SummarizeJob(type="summarize", id=f"k{i}", max_tokens=8, text=f"Item {i} of ten.")
            for i in range(10)]  # fmt: skip
    batch_id = f"packs-{uuid.uuid4().hex[:8]}"
    packing.submit_many(jobs[3:4], batch=batch_id, seal=False)
    batch = packing.submit_many(jobs, batch=batch_id)
    # Then they wait as four messages: the early one alone, then the ten framed 4, 4, 2, less
    # the one sent before (its message is queued already)
    messages = [m for key in queue_keys(held) for m in redis_client.lrange(key, 0, -1)]

    def carried(message: str) -> int:
        arg = json.loads(json.loads(message)["body"])[0][0]
        return len(arg) if isinstance(arg, list) else 1

    assert sorted(carried(m) for m in messages) == [1, 2, 3, 4]
    # When the worker takes them, and afterwards one pack is delivered again
    for key in queue_keys(held):
        while redis_client.rpoplpush(key, key.replace(held, worker.queue, 1)):
            pass
    st = batch.wait(timeout=300)

    def duplicates() -> float:
        name = 'vqueue_jobs_duplicate_total{type="summarize"} '
        text = urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics").read()
        lines = text.decode().splitlines()
        return sum(float(x.split()[-1]) for x in lines if x.startswith(name))

    before = duplicates()
    redis_client.lpush(queue_keys(worker.queue)[0], max(messages, key=carried))
    # Then the worker finds each of the redelivered pack's four jobs done and runs none again
    wait_for(lambda: duplicates() - before >= 4, 60, "the pack's four jobs as duplicates")
    # and every job ran once: ten results, none twice
    results = list(batch.results(timeout=60))
    assert (st.total, st.completed) == (10, 10)
    assert sorted(r.id for r in results) == sorted(j.id for j in jobs)
    assert all(r.status == "completed" and r.text for r in results)
    assert batch.status().completed == 10


def _gauge(port: int, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(float(x.split()[1]) for x in text.splitlines() if x.startswith(name + " "))


def test_json_object_jobs_return_json(client: Client) -> None:
    # Given a chat job that asks for any JSON object (OpenAI's response_format json_object)
    job = {"type": "chat", "id": "obj", "json_object": True, "max_tokens": 48,
           "messages": [{"role": "user", "content": "Give Ann's age (31) as JSON."}]}  # fmt: skip
    res = client.submit(job).result("obj", timeout=120)
    # Then it completes with a parsed JSON object, or fails as cut off: never invalid JSON
    if res.status == "completed":
        assert isinstance(res.data, dict) and json.loads(res.text or "") == res.data
    else:
        assert res.error is not None and res.error.type == "schema_incomplete"


def test_a_chat_job_with_n_answers_n_times_each_seeded(client: Client) -> None:
    # Given a sampled chat job asking for three choices of exactly 12 tokens, with a seed,
    # submitted twice
    job = {"type": "chat", "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 12,
           "min_tokens": 12, "ignore_eos": True,
           "messages": [{"role": "user", "content": "Name a colour."}]}  # fmt: skip
    batch = client.submit_many([{**job, "id": "n1"}, {**job, "id": "n2"}])
    got = {r.id: r for r in batch.results(timeout=300)}
    first, again = got["n1"], got["n2"]
    # Then each has three choices in order, the first also its text, each its own sample
    assert first.status == "completed" and first.choices is not None, first.error
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert first.text == first.choices[0].text
    assert len({c.text for c in first.choices}) > 1, first.choices
    # with the prompt counted once and every choice's tokens
    assert first.usage.completion_tokens == 36 and first.usage.prompt_tokens > 0
    # and the same seed gives the same three answers
    assert again.choices is not None
    assert [c.text for c in again.choices] == [c.text for c in first.choices]


def test_a_chat_job_asking_for_logprobs_gets_each_tokens_and_the_likeliest(
    client: Client,
) -> None:
    # Given a greedy chat job of exactly 8 tokens asking for the 3 likeliest at each place
    ask = [{"role": "user", "content": "Count from one to ten in words."}]
    job = {"type": "chat", "id": "lp", "logprobs": 3, "max_tokens": 8, "min_tokens": 8,
           "ignore_eos": True, "messages": ask}  # fmt: skip
    r = client.submit(job).result("lp", timeout=300)
    assert r.status == "completed" and r.logprobs is not None, r.error
    # Then there is one entry per answer token, their texts making up the answer
    assert len(r.logprobs) == r.usage.completion_tokens == 8
    assert "".join(t.token for t in r.logprobs) == r.text
    for t in r.logprobs:
        # each with its bytes, and three alternatives, likeliest first, the greedy pick the first
        assert t.bytes == list(t.token.encode()) and t.logprob <= 0
        alts = [a.logprob for a in t.top_logprobs]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True)
        assert t.top_logprobs[0].token == t.token and abs(alts[0] - t.logprob) < 1e-4


def test_single_job_submit_and_wait(client: Client) -> None:
    batch = client.submit(
        {"type": "summarize", "id": "one", "text": "Cats sleep a lot.", "max_tokens": 24}
    )
    res = batch.result("one", timeout=120)
    assert res.status == "completed" and res.text


def test_async_client(client: Client) -> None:
    async def go() -> list:
        ac = AsyncClient(make_settings(client.settings.queue))
        try:
            b = await ac.submit_many(
                [
                    {
                        "type": "summarize",
                        "id": f"a{i}",
                        "text": f"Note {i}: buy milk.",
                        "max_tokens": 16,
                    }
                    for i in range(3)
                ]
            )
            return [r async for r in ac.results(b, timeout=120)]
        finally:
            await ac.aclose()

    results = asyncio.run(go())
    assert sorted(r.id for r in results) == ["a0", "a1", "a2"]
    assert all(r.status == "completed" for r in results)


def test_async_client_errors_and_timeouts(client: Client) -> None:
    async def go() -> None:
        ac = AsyncClient(make_settings(client.settings.queue))
        try:
            # a batch that does not exist is BatchNotFound, not a hang
            with pytest.raises(BatchNotFound):
                await ac.status("no-such-batch")
            with pytest.raises(BatchNotFound):
                async for _ in ac.results("no-such-batch", timeout=5):
                    pass
            # a job with a bad field is refused before anything is sent
            with pytest.raises(ValueError, match="max_tokens"):
                await ac.submit({"type": "summarize", "text": "x", "max_tokens": -1})
            # a batch that cannot finish in time raises WaitTimeout after the timeout
            slow = {"type": "summarize", "text": "Count.", "max_tokens": 400, "min_tokens": 400,
                    "ignore_eos": True}  # fmt: skip
            b = await ac.submit(slow)
            with pytest.raises(WaitTimeout):
                async for _ in ac.results(b, timeout=1):
                    pass
            assert [r.status async for r in ac.results(b, timeout=300)] == ["completed"]
        finally:
            await ac.aclose()

    asyncio.run(go())


COMPLETION_PROMPT = "The three primary colors are red,"


def test_openai_batch_file_round_trips(worker: WorkerProc, tmp_path: Path) -> None:
    # Given an OpenAI Batch API input file, one line asking for a JSON schema, one naming a
    # model no worker of the queue serves, a /v1/completions and a /v1/responses request
    place = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    lines = [
        {
            "custom_id": "q1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "smollm2-135m-instruct",
                "max_tokens": 24,
                "messages": [{"role": "user", "content": "Say hello."}],
            },
        },
        {
            "custom_id": "q2",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "smollm2-135m-instruct",
                "max_tokens": 32,
                "messages": [{"role": "user", "content": "Where is the Eiffel Tower?"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "place", "schema": place},
                },
            },
        },
        {
            "custom_id": "q3",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi."}]},
        },
        {
            "custom_id": "q4",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": "smollm2-135m-instruct",
                "prompt": COMPLETION_PROMPT,
                "max_tokens": 12,
                "logprobs": 2,
            },
        },
        {
            "custom_id": "q5",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": "smollm2-135m-instruct",
                "instructions": "Answer in one word.",
                "input": "What colour is the sky?",
                "max_output_tokens": 8,
            },
        },
    ]
    # and three lines with tools: calls required (one at most), a named function, auto
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"], "additionalProperties": False}  # fmt: skip
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    tools = [weather, {"type": "function", "function": {"name": "get_time"}}]
    for cid, choice in (("t1", "required"), ("t2", {"type": "function", "function": {
            "name": "get_weather"}}), ("t3", None)):  # fmt: skip
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        body = {"model": "smollm2-135m-instruct", "max_tokens": 64, "tools": tools,
                "messages": ask}  # fmt: skip
        if choice:
            body |= {"tool_choice": choice, "parallel_tool_calls": False}
        lines.append({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                      "body": body})  # fmt: skip
    # and one that goes on after a call: the call, the tool's answer, then the model's turn
    made = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [made]},
               {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21C."}]  # fmt: skip
    lines.append({"custom_id": "t4", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "smollm2-135m-instruct", "max_tokens": 24, "tools": tools,
                           "messages": history}})  # fmt: skip
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    # When it is submitted with --wait
    proc = run_cli("submit", str(src), "--wait", "--out", str(out), "--errors", str(err), "-q")
    assert proc.returncode == 0, proc.stderr.decode()
    # Then the output file is OpenAI batch output, one line per custom_id
    got = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert set(got) == {"q1", "q2", "q4", "q5", "t1", "t2", "t3", "t4"}
    completion = got.pop("q4")["response"]["body"]
    response = got.pop("q5")["response"]["body"]
    # and the tool lines answer as the openai SDK reads them: required, one call of a given
    # tool, its arguments held to that tool's parameters, ended "tool_calls"; named, a call of
    # that function, ended "stop"; auto, text (no tool-call parser: vLLM's server answers so;
    # this model's template leaves tools out, so guided decoding alone makes the calls)
    from openai.types.chat import ChatCompletion

    called = {}
    for cid in ("t1", "t2"):
        (c,) = ChatCompletion.model_validate(got.pop(cid)["response"]["body"]).choices
        assert c.message.content is None and len(c.message.tool_calls or []) == 1, c
        called[cid] = (c.finish_reason, c.message.tool_calls[0].function)  # type: ignore[index]
    (reason, call) = called["t1"]
    assert reason == "tool_calls" and call.name in ("get_weather", "get_time"), called
    if call.name == "get_weather":
        jsonschema.validate(json.loads(call.arguments), city)
    (reason, call) = called["t2"]
    assert reason == "stop" and call.name == "get_weather", called
    jsonschema.validate(json.loads(call.arguments), city)
    for cid in ("t3", "t4"):
        (c,) = ChatCompletion.model_validate(got.pop(cid)["response"]["body"]).choices
        assert c.message.tool_calls is None and c.message.content, c
    for line in got.values():
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "smollm2-135m-instruct"
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["total_tokens"] > 0
    data = json.loads(got["q2"]["response"]["body"]["choices"][0]["message"]["content"])
    jsonschema.validate(data, place)
    # and the completions line came back a text_completion of its bare prompt, no chat template
    # around it (its prompt tokens are the tokenizer's own encoding), with legacy logprobs
    from transformers import AutoTokenizer

    from worker.models import prepare_embedded

    assert completion["object"] == "text_completion", completion
    (choice,) = completion["choices"]
    n = completion["usage"]["completion_tokens"]
    assert choice["text"] and 1 <= n <= 12, completion
    tokens = AutoTokenizer.from_pretrained(prepare_embedded())(COMPLETION_PROMPT).input_ids
    assert completion["usage"]["prompt_tokens"] == len(tokens)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert "".join(lp["tokens"]) == choice["text"] and lp["text_offset"][0] == 0
    # and the responses line came back a response object, as the openai SDK reads it
    from openai.types.responses import Response

    assert response["object"] == "response" and response["status"] in ("completed", "incomplete")
    assert Response.model_validate(response).output_text, response
    # and the line naming another model failed alone, with the 404 vLLM's server answers
    (bad,) = map(json.loads, err.read_text().splitlines())
    assert bad["custom_id"] == "q3" and bad["response"]["status_code"] == 404, bad
    error = bad["response"]["body"]["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "`gpt-4o` does not exist" in error["message"]
    assert "`smollm2-135m-instruct`" in error["message"]
    # and the batch id on stdout reads the same results back
    batch = proc.stdout.decode().strip()
    again = run_cli("results", batch)
    read = {json.loads(x)["custom_id"] for x in again.stdout.decode().splitlines()}
    assert read == {"q1", "q2", "q3", "q4", "q5", "t1", "t2", "t3", "t4"}


def test_an_errors_file_writes_each_line_in_its_own_format(
    worker: WorkerProc, tmp_path: Path
) -> None:
    # Given a file mixing a good vqueue line, a bad one, a bad OpenAI request line, and a line
    # that is not JSON at all after it
    src, err = tmp_path / "mixed.jsonl", tmp_path / "err.jsonl"
    src.write_text(
        '{"id": "ok", "type": "summarize", "text": "Hi.", "max_tokens": 4}\n'
        '{"id": "v-bad", "text": "no type"}\n'
        '{"custom_id": "o-bad", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
        "not json\n"
    )
    # When it is submitted with --errors
    proc = run_cli("submit", str(src), "--wait", "--errors", str(err), "-q")
    assert proc.returncode == 0, proc.stderr.decode()
    # Then the vqueue line is a failed result, as a worker's failures are, and the OpenAI line
    # an OpenAI batch error line; the unreadable line takes the format of the file so far
    vq, oa, unread = map(json.loads, err.read_text().splitlines())
    assert (vq["id"], vq["status"], vq["line"]) == ("v-bad", "failed", 2), vq
    assert vq["error"]["type"] == "invalid_job" and "missing field 'type'" in vq["error"]["message"]
    assert oa["custom_id"] == "o-bad" and oa["error"]["line"] == 3, oa
    assert unread["custom_id"] is None and unread["error"]["line"] == 4, unread
    assert "not valid JSON" in unread["error"]["message"]


@pytest.mark.parametrize("content", [None, b"", b"not json\n[1]\n"])
def test_unusable_input_file_exits_non_zero(tmp_path: Path, content: bytes | None) -> None:
    src = tmp_path / "input.jsonl"
    if content is not None:
        src.write_bytes(content)
    proc = run_cli("submit", str(src), "-q")
    stderr = proc.stderr.decode()
    assert proc.returncode == 3, stderr
    assert stderr.splitlines()[-1].startswith("vqueue: ") and "Traceback" not in stderr
    assert proc.stdout == b""  # no batch id: nothing was enqueued


def test_unreachable_broker_is_one_line_and_exit_4() -> None:
    proc = run_cli("--broker", "redis://127.0.0.1:1/0", "status", timeout=60)
    assert proc.returncode == 4
    assert proc.stderr.decode().startswith("vqueue: cannot reach Redis")


@pytest.mark.parametrize("name", ["V:done", "a b", "../x", "-x", "x" * 129, "b*"])
def test_unsafe_batch_ids_are_refused(name: str, tmp_path: Path) -> None:
    # batch ids become Redis keys and half of each task id: `--batch V:done` would have been
    # batch V's done map
    src = tmp_path / "in.jsonl"
    src.write_text('{"type": "summarize", "text": "x"}\n')
    proc = run_cli("submit", str(src), "--batch", name, "-q")
    assert proc.returncode == 2 and b"is not allowed" in proc.stderr, proc.stderr
    with pytest.raises(ValueError, match="is not allowed"):
        Client(make_settings()).submit_many([{"type": "summarize", "text": "x"}], batch=name)
