"""OpenAI's Files and Batches API over the queue (``vqueue serve``), driven by the official
``openai`` SDK against a real server process, the session's real worker and engine, and Redis
(docs/http-api.md)."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from .conftest import (
    KEY_PREFIX,
    MAIN_QUEUE,
    Procs,
    WorkerProc,
    free_port,
    run_cli,
    wait_for,
    worker_env,
)

pytestmark = pytest.mark.engine


class Api:
    def __init__(self, url: str, keys: dict[str, str], files: Path) -> None:
        self.url, self.keys, self.files = url, keys, files

    def sdk(self, tenant: str = "team-a", key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or self.keys[tenant],
                             max_retries=0)  # fmt: skip


@pytest.fixture(scope="module")
def api(module_procs: Procs, worker: WorkerProc, tmp_path_factory: pytest.TempPathFactory) -> Api:
    keys = {}
    for tenant in ("team-a", "team-b"):
        made = run_cli("keys", "create", tenant)
        assert made.returncode == 0, made.stderr
        keys[tenant] = made.stdout.decode().strip()
    port = free_port()
    files = tmp_path_factory.mktemp("files")
    env = worker_env(MAIN_QUEUE, VQUEUE_FILES_DIR=str(files), VQUEUE_API_POLL_S="0.2")
    log = open(worker.log_path.parent / "api.log", "w")  # noqa: SIM115
    module_procs.popen([sys.executable, "-m", "producer.cli", "serve", "--port", str(port)],
                       env=env, stdout=log, stderr=log)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                return bool(json.loads(r.read())["status"] == "ok")
        except OSError:
            return False

    wait_for(up, 60, "vqueue serve to answer /healthz")
    return Api(url, keys, files)


MODEL = "smollm2-135m-instruct"  # the name the session's worker serves (the embedded default)


def _chat(cid: str, text: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}],
                     "max_tokens": 24, **body}}  # fmt: skip


def _upload(sdk: openai.OpenAI, tmp: Path, lines: list[Any]) -> Any:
    path = tmp / "input.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with open(path, "rb") as fh:
        return sdk.files.create(file=fh, purpose="batch")


def _until(sdk: openai.OpenAI, bid: str, states: tuple[str, ...], timeout: float = 600) -> Any:
    seen: list[Any] = [None]

    def reached() -> Any:
        seen[0] = b = sdk.batches.retrieve(bid)
        return b.status in states and b

    try:
        return wait_for(reached, timeout, f"{bid} to reach {states}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen[0]}") from None


def _lines(sdk: openai.OpenAI, fid: str | None) -> Iterator[dict[str, Any]]:
    if fid is None:
        return iter(())
    return (json.loads(x) for x in sdk.files.content(fid).text.splitlines())


def test_a_batch_through_the_sdk_from_upload_to_output_and_error_files(
    api: Api, tmp_path: Path
) -> None:
    sdk = api.sdk()
    # Given an input file of chat requests, one of which cannot fit its JSON in 4 tokens
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 100}},
              "required": ["story"]}  # fmt: skip
    lines = [_chat(f"q{i}", f"Say hello to person number {i}.") for i in range(3)]
    lines.append(_chat("cut", "Tell a story.", max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}))  # fmt: skip
    f = _upload(sdk, tmp_path, lines)
    assert f.purpose == "batch" and f.bytes > 0 and f.id.startswith("file-")
    # When a batch is created on it and polled to its end
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                           completion_window="24h", metadata={"owner": "test"})  # fmt: skip
    assert b.status == "validating" and b.metadata == {"owner": "test"}
    done = _until(sdk, b.id, ("completed", "failed"))
    # Then it completed with every request counted, and each *_at stamp in order
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed) == (4, 3)
    assert done.request_counts.failed == 1
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    # and the output file has one chat completion per good request, the error file the other
    out = {x["custom_id"]: x for x in _lines(sdk, done.output_file_id)}
    assert set(out) == {"q0", "q1", "q2"}
    for x in out.values():
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and x["error"] is None
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    errs = list(_lines(sdk, done.error_file_id))
    assert [(x["custom_id"], x["error"]["code"]) for x in errs] == [("cut", "schema_incomplete")]
    # and the files are listed, described and deletable like OpenAI's
    listed = {x.id for x in sdk.files.list().data}
    assert {f.id, done.output_file_id, done.error_file_id} <= listed
    assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert b.id in {x.id for x in sdk.batches.list(limit=100).data}
    assert sdk.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(f.id)


def test_an_input_file_with_bad_lines_fails_with_their_line_numbers(
    api: Api, tmp_path: Path
) -> None:
    sdk = api.sdk()
    # Given a file whose lines 2 and 4 are not requests, and line 3 is a vqueue job, not a chat
    lines = [_chat("ok", "hi"), "not json", {"type": "summarize", "text": "t"},
             {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}]  # fmt: skip
    f = _upload(sdk, tmp_path, lines)
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                           completion_window="24h")  # fmt: skip
    done = _until(sdk, b.id, ("failed", "completed", "in_progress"), 60)
    # Then the batch failed before running anything, naming each bad line
    assert done.status == "failed" and done.failed_at
    assert [e.line for e in done.errors.data] == [2, 3, 4]
    assert all(e.code == "invalid_request" and e.message for e in done.errors.data)
    assert done.output_file_id is None


def test_a_batch_whose_input_is_gone_from_disk_fails_saying_why(api: Api, tmp_path: Path) -> None:
    # Given an uploaded file whose contents vanished from the server's disk
    sdk = api.sdk()
    f = _upload(sdk, tmp_path, [_chat("x", "hi")])
    (api.files / f.id).unlink()
    # Then a batch on it fails saying so, with no server path in the message, never stays
    # validating
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                           completion_window="24h")  # fmt: skip
    done = _until(sdk, b.id, ("failed",), 60)
    error = done.errors.data[0]
    assert (error.code, error.message) == ("file_not_found", "the input file was deleted")


def test_another_tenant_gets_404_and_a_bad_key_401(api: Api, tmp_path: Path) -> None:
    a, b = api.sdk("team-a"), api.sdk("team-b")
    f = _upload(a, tmp_path, [{"type": "summarize", "text": "A short note.", "max_tokens": 8}])
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                             completion_window="24h")  # fmt: skip
    # Then tenant B can neither see, read, use nor cancel tenant A's file and batch
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id),
                 lambda: b.files.delete(f.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                                          completion_window="24h")):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in {x.id for x in b.files.list().data}
    assert batch.id not in {x.id for x in b.batches.list().data}
    # and a wrong key is refused outright
    with pytest.raises(openai.AuthenticationError):
        api.sdk(key="vq-not-a-key").files.list()
    # while A's own vqueue job runs, its output line carrying the vqueue result
    done = _until(a, batch.id, ("completed", "failed"))
    (line,) = list(_lines(a, done.output_file_id))
    assert line["response"]["body"]["type"] == "summarize" and line["response"]["body"]["text"]


def _slow(n: int, tokens: int = 40) -> list[dict[str, Any]]:
    return [{"id": f"s{i}", "type": "summarize", "text": f"Report {i}: sales rose in every "
             "region this quarter.", "max_tokens": tokens, "min_tokens": tokens,
             "ignore_eos": True} for i in range(n)]  # fmt: skip


def test_cancel_mid_run_keeps_what_finished(api: Api, tmp_path: Path, redis_client: Any) -> None:
    sdk = api.sdk()
    # Given a batch of 60 jobs, more than the worker runs at once
    f = _upload(sdk, tmp_path, _slow(60))
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                           completion_window="24h")  # fmt: skip
    running = wait_for(lambda: (r := sdk.batches.retrieve(b.id)).request_counts.completed >= 1
                       and r, 600, "a result")  # fmt: skip
    # While it runs, its counts come from their own fields: the stored object is not rewritten
    key = f"{KEY_PREFIX}:api:batch:{b.id}"
    stored = redis_client.hget(key, "obj")
    more = running.request_counts.completed + 2
    wait_for(lambda: sdk.batches.retrieve(b.id).request_counts.completed >= more, 600, "more")
    assert redis_client.hget(key, "obj") == stored
    # and the output file grows as results arrive, each leaving Redis once written there
    out_key = f"{KEY_PREFIX}:api:out:{b.id}"
    wait_for(lambda: int(redis_client.hget(out_key, "ok_n") or 0) >= 1, 30, "a line written")
    ok_path = api.files / redis_client.hget(out_key, "ok")
    size = ok_path.stat().st_size
    wait_for(lambda: ok_path.stat().st_size > size, 600, "the output file to grow")
    stream = f"{KEY_PREFIX}:batch:{b.id}:results"
    wait_for(lambda: redis_client.xlen(stream) == 0, 30, "the written results to leave Redis")
    # When it is cancelled once some have finished
    c = sdk.batches.cancel(b.id)
    assert c.status == "cancelling" and c.cancelling_at
    done = _until(sdk, b.id, ("cancelled",), 600)
    # Then the batch is cancelled: what finished is in the output file, the rest cancelled
    counts = done.request_counts
    assert counts.completed >= 1 and counts.failed >= 1 and counts.total == 60
    assert counts.completed + counts.failed == 60
    out = list(_lines(sdk, done.output_file_id))
    errs = list(_lines(sdk, done.error_file_id))
    assert len(out) == counts.completed and len(errs) == counts.failed
    assert {x["error"]["code"] for x in errs} == {"cancelled"}
    assert done.output_file_id == ok_path.name  # the file that grew is the output file


def test_a_short_completion_window_expires_the_batch_with_partial_output(
    api: Api, tmp_path: Path
) -> None:
    sdk = api.sdk()
    # Given a batch of 60 jobs that cannot finish in its 3-second window
    f = _upload(sdk, tmp_path, _slow(60))
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                           completion_window="3s")  # type: ignore[arg-type]  # fmt: skip
    assert b.expires_at == b.created_at + 3
    done = _until(sdk, b.id, ("expired", "completed"), 600)
    # Then it expired: jobs not started by the deadline were withdrawn, the finished ones kept
    assert done.status == "expired" and done.expired_at >= b.expires_at
    counts = done.request_counts
    assert counts.completed >= 1 and counts.failed >= 1 and counts.completed + counts.failed == 60
    assert {x["error"]["code"] for x in _lines(sdk, done.error_file_id)} == {"expired"}
    assert len(list(_lines(sdk, done.output_file_id))) == counts.completed


def test_vqueue_cancel_withdraws_a_batch_submitted_by_the_client(client: Any) -> None:
    # Given a batch submitted with the Python client, more than the worker runs at once, each
    # job long enough that the batch cannot finish while the command line starts (at 40 tokens
    # a job it once did, on CI's two cores)
    batch = client.submit_many(_slow(40, tokens=300))
    wait_for(lambda: batch.status().done >= 1, 600, "a first result")
    # When it is cancelled from the command line
    done = run_cli("cancel", batch.id)
    assert done.returncode == 0, done.stderr
    # Then every job ends: the finished ones kept, the rest cancelled, none lost
    results = list(batch.results(timeout=600))
    assert len(results) == 40
    kinds = {r.error.type if r.error else r.status for r in results}
    assert kinds == {"completed", "cancelled"}, kinds
    # and an unknown batch is exit 5
    assert run_cli("cancel", "no-such-batch").returncode == 5


def test_cancel_aborts_the_jobs_already_generating(client: Any, worker: WorkerProc) -> None:
    # Given jobs that generate 1,500 tokens each (minutes on this CPU), all running
    long = {"max_tokens": 1500, "min_tokens": 1500, "ignore_eos": True}
    jobs = [{"id": f"long{i}", "type": "summarize", "text": f"Report {i}.", **long} for i in "abc"]
    sent = time.time()
    batch = client.submit_many(jobs)

    def running() -> bool:  # a heartbeat from after they arrived (one before may show others)
        mine = [w for w in client.store.workers() if w.get("name") == worker.node]
        return bool(mine) and mine[0]["updated_at"] > sent + 1 and mine[0]["in_flight"] >= 3

    wait_for(running, 120, "the three jobs to be generating")
    # When the batch is cancelled
    t0 = time.monotonic()
    assert client.cancel(batch.id)
    results = list(batch.results(timeout=120))
    # Then they were aborted in the engine within seconds, each recorded as cancelled
    assert time.monotonic() - t0 < 30
    for r in results:
        assert r.status == "failed" and r.error and r.error.type == "cancelled", r
        assert "aborted in the engine" in r.error.message


def test_an_http_batch_whose_canary_fails_pauses_then_resumes_or_cancels(
    api: Api, tmp_path: Path
) -> None:
    sdk = api.sdk()
    text = "The river rose two metres overnight; the bridge was closed and the school shut."
    lines = [{"id": f"h{i}", "type": "summarize", "text": f"canary {i}: {text}", "max_tokens": 4}
             for i in range(20)]  # fmt: skip
    # a canary that is not a share is refused at once
    f = _upload(sdk, tmp_path, lines)
    with pytest.raises(openai.BadRequestError, match="canary"):
        sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                           completion_window="24h", metadata={"canary": "most"})  # fmt: skip
    # Given two batches of answers that all run to max_tokens, behind a canary
    made = [sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                               completion_window="24h", metadata={"canary": "5%"})
            for _ in range(2)]  # fmt: skip
    # Then each pauses after its canary: 10 jobs run, the batch in progress, saying why
    for b in made:
        paused = wait_for(
            lambda b=b: (
                (r := sdk.batches.retrieve(b.id)).model_extra and r.model_extra.get("paused") and r
            ),
            300,
            "the canary to pause it",
        )
        extra = paused.model_extra
        assert paused.status == "in_progress" and extra["canary"]["jobs"] == 10, paused
        assert "VQUEUE_CANARY_MAX_LENGTH" in " ".join(extra["canary"]["reasons"])
        time.sleep(1.0)  # the server's sweep runs meanwhile; a paused batch is not fed
        assert sdk.batches.retrieve(b.id).request_counts.completed == 10
    # When the first is resumed, Then the server sends the rest, each line once
    resumed = run_cli("resume", made[0].id)
    assert resumed.returncode == 0 and b"the API server" in resumed.stderr, resumed.stderr
    done = _until(sdk, made[0].id, ("completed",), 300)
    assert (done.request_counts.completed, done.request_counts.total) == (20, 20), done
    ids = sorted(x["custom_id"] for x in _lines(sdk, done.output_file_id))
    assert ids == sorted(f"h{i}" for i in range(20))
    # and when the second is cancelled, Then it ends with the canary's answers
    sdk.batches.cancel(made[1].id)
    ended = _until(sdk, made[1].id, ("cancelled",), 300)
    assert (
        ended.request_counts.completed == 10 and len(list(_lines(sdk, ended.output_file_id))) == 10
    )
