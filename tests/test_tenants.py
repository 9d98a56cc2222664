"""A hostile or careless tenant against the service: schemas that would exhaust the process that
checks them, a tenant that floods the schema checks, and a Redis that fills up (maxmemory,
noeviction) under a batch.

The schema checks run llguidance for real, in the child processes that bound them. The Redis-full
tests run real ``vqueue`` commands and a real worker process on the FAKE engine
(``tests/fake_engine.py``): what is under test is what reaches Redis and what a refused write
does to the queue, not generation. The HTTP test runs a real ``vqueue serve``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from producer.grammar_check import Checker, Limits
from schemas import ExtractJob

from .conftest import (
    KEY_PREFIX,
    WORKDIR,
    Procs,
    RedisServer,
    free_port,
    run_cli,
    wait_for,
    worker_env,
)

# Within every static bound (counts at most 32,768), yet its grammar takes about 170 MB to build.
HUNGRY = {
    "anyOf": [
        {"type": "array", "items": {"type": t}, "maxItems": 32768 - i}
        for i, t in enumerate(("integer", "string", "boolean", "number"))
    ]
}
PLAIN = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _slow(i: int) -> dict[str, Any]:
    """A distinct schema whose check takes about a second (llguidance refuses it for size)."""
    return {
        "anyOf": [
            {"type": "array", "maxItems": 32768, "items": {"type": "integer", "minimum": n}}
            for n in range(100 * i, 100 * i + 8)
        ]
    }


# ----------------------------------------------------------------------- the schema checks
@pytest.mark.unit
def test_a_schema_asking_for_a_billion_items_is_refused_without_compiling() -> None:
    # Given the line that took the API server down: maxItems 1e9
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000_000}
    # When it is validated, Then it is refused on its face, naming the keyword and the limit
    with pytest.raises(ValidationError, match="maxItems=1000000000; counts in a schema are"):
        ExtractJob(type="extract", text="x", json_schema=schema)
    for word in ("maxLength", "maxProperties", "maxContains"):
        with pytest.raises(ValidationError, match=f"{word}=40000"):
            ExtractJob(type="extract", text="x", json_schema={"type": "string", word: 40000})


@pytest.mark.unit
def test_a_schema_whose_grammar_needs_more_memory_than_allowed_is_refused() -> None:
    # Given checks limited to 150 MiB each
    checker = Checker(Limits(memory_bytes=150 << 20))
    try:
        # When a schema needing more is checked, Then it is refused for memory, and the asker
        # (this process) is untouched; the next schema is checked on a fresh child
        assert checker.problem(json.dumps(HUNGRY)) == (
            "json_schema's grammar needs more than 150 MiB to compile"
        )
        assert checker.problem(json.dumps(PLAIN)) is None
        # and with room, the same schema compiles: the limit, not the schema, refused it
        roomy = Checker(Limits())
        assert roomy.problem(json.dumps(HUNGRY)) is None
        roomy.close()
    finally:
        checker.close()


@pytest.mark.unit
def test_a_check_past_its_time_is_killed_and_not_remembered() -> None:
    # Given a schema whose check takes about a second and a time limit far below it (a quick
    # schema could be answered while the asking thread waits for the CPU)
    checker = Checker(Limits(timeout_s=1e-4))
    text = json.dumps(_slow(50))
    try:
        # When it is checked, Then it is refused for time, and its child is killed
        assert checker.problem(text) == "json_schema's grammar did not compile within 0.0001s"
        assert checker._idle == []
        # and once the limit allows it, the same schema gets llguidance's own answer: the
        # time-out was not remembered as its answer
        checker.limits = Limits()
        answer = checker.problem(text) or ""
        assert answer.startswith("json_schema cannot be enforced by guided decoding"), answer
    finally:
        checker.close()


@pytest.mark.unit
def test_one_tenant_flooding_the_checks_leaves_the_others_a_child() -> None:
    # Given two children, one tenant holding at most one, and that tenant's six slow schemas
    checker = Checker(Limits(children=2, per_tenant=1))
    finished: list[str] = []
    lock = threading.Lock()

    def check(who: str, schema: dict[str, Any]) -> None:
        checker.problem(json.dumps(schema), who)
        with lock:
            finished.append(who)

    flood = [threading.Thread(target=check, args=("a", _slow(i))) for i in range(6)]
    try:
        for t in flood:
            t.start()
        wait_for(lambda: checker._held.get("a") == 1, 30, "tenant a's first check to start")
        # When another tenant's plain schema comes, Then it is checked beside the flood, not
        # after it: it ends before the flood's second check does
        check("b", PLAIN)
        with lock:
            assert finished.index("b") <= 1, finished
        for t in flood:
            t.join(120)
        assert Counter(finished) == {"a": 6, "b": 1}
    finally:
        checker.close()


# ------------------------------------------------------------------------ Redis at maxmemory
def _cli(
    *args: str, url: str, timeout: float = 300, **env: str
) -> subprocess.CompletedProcess[bytes]:
    return run_cli(*args, queue="full", timeout=timeout, VQUEUE_BROKER_URL=url, **env)


def _write_jobs(path: Path, n: int, prefix: str = "j") -> None:
    text = "A short document about the weather, repeated. " * 4
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"{prefix}{i:06d}", "type": "summarize", "text": text}))
            fh.write("\n")


@pytest.mark.parametrize("per_message", ["1", "8"])
def test_redis_full_loses_no_job_and_stops_no_worker(
    procs: Procs, tmp_path: Path, per_message: str
) -> None:
    # Given a worker (fake engine) and a Redis whose maxmemory holds a few thousand jobs, the
    # jobs one to a message, or in packs whose starts and results go to Redis together
    server: RedisServer = procs.redis(tmp_path / "redis", aof=False)
    r = redis.Redis.from_url(server.url, decode_responses=True)
    packs = {"VQUEUE_JOBS_PER_MESSAGE": per_message}
    w = procs.fake_worker("full", server.url, delay=0.05, concurrency=32, queue="full", **packs)
    w.wait_ready(r)
    # 20,000 in CI; the 100,000 with VQTEST_REDIS_FULL_JOBS=100000
    n = int(os.environ.get("VQTEST_REDIS_FULL_JOBS", "20000"))
    slow = max(1.0, n / 20_000)  # waits grow with the batch
    jobs = tmp_path / "jobs.jsonl"
    _write_jobs(jobs, n)
    r.config_set("maxmemory", str(r.info("memory")["used_memory"] + 6 * 1024**2))
    # When the whole file is submitted
    sub = _cli("submit", str(jobs), "--quiet", url=server.url, **packs)
    # Then submission stops with one line and exit 11, the batch id on stdout as on success
    stderr = sub.stderr.decode()
    assert sub.returncode == 11, stderr
    assert "Traceback" not in stderr and "Redis is full (maxmemory)" in stderr, stderr
    batch = sub.stdout.decode().split()[-1]
    status = json.loads(_cli("status", batch, "--json", url=server.url).stdout)
    sent = status["total"]
    assert 0 < sent < n and "Redis is full" in status["error"], status
    # When Redis stays full while the worker runs the jobs that were sent (its limit below
    # what it holds), Then the worker waits, both to record the jobs it has run and, one job a
    # message, for one of the broker's own writes (taking a job records it unacked; acking
    # removes it: which meets the full Redis first depends on where each thread is), and stays
    # up. Packs each wait where the full Redis finds them, to start (taken just before), to
    # record, or to be acknowledged (started and recorded just before), holding their share of
    # the prefetch until room comes: which of the writes meets it first depends on the timing
    r.config_set("maxmemory", str(r.info("memory")["used_memory"] - 512 * 1024))
    done_then = _done(r, batch)

    def waited() -> bool:
        if per_message == "1":
            broker = _full_waits(w, "consume") or _full_waits(w, "ack")
            return bool(_full_waits(w, "record") and broker)
        return any(_full_waits(w, op) for op in ("start", "record", "consume", "ack"))

    try:
        wait_for(waited, 120, "the worker to wait for room for its own writes, and the broker's")
    except AssertionError as exc:
        waits = {op: _full_waits(w, op) for op in ("start", "record", "consume", "ack")}
        raise AssertionError(
            f"{exc}: {sent} sent, {done_then} done as Redis filled, {_done(r, batch)} now; "
            f"waits {waits}\nworker log:\n{w.log_path.read_text()[-4000:]}"
        ) from None
    assert w.proc.poll() is None
    # When memory is freed
    r.config_set("maxmemory", "0")
    # Then every job that was sent ends with exactly one result, and the worker is still up
    wait_for(lambda: _done(r, batch) >= sent, 300 * slow, "the sent jobs to finish")
    assert _one_result_each(r, batch) == sent
    assert w.proc.poll() is None
    assert "Unrecoverable" not in w.log_path.read_text()
    # and submitting the same file again into the batch sends only the rest: all n, once each
    again = _cli("submit", str(jobs), "--batch", batch, "--wait", "--quiet", url=server.url,
                 timeout=300 * slow, **packs)  # fmt: skip
    assert again.returncode == 0, again.stderr.decode()
    assert _one_result_each(r, batch) == n
    assert w.proc.poll() is None


def _full_waits(w: Any, op: str) -> float:
    """The worker's ``vqueue_redis_full_waits_total{op}``, from its /metrics."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5) as f:
            text = f.read().decode()
    except OSError:
        return 0.0
    prefix = f'vqueue_redis_full_waits_total{{op="{op}"}}'
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(prefix))


def _done(r: redis.Redis, batch: str) -> int:
    from .conftest import KEY_PREFIX

    h = r.hgetall(f"{KEY_PREFIX}:batch:{batch}")
    return int(h.get("completed", 0)) + int(h.get("failed", 0))


def _one_result_each(r: redis.Redis, batch: str) -> int:
    """The number of jobs with a result; fails if any job has two."""
    from .conftest import KEY_PREFIX

    ids: Counter[str] = Counter()
    for _, fields in r.xrange(f"{KEY_PREFIX}:batch:{batch}:results"):
        ids[fields["id"]] += 1
    assert not ids or max(ids.values()) == 1, ids.most_common(3)
    return len(ids)


# ------------------------------------------------------------------------- the HTTP server
class Served:
    """A ``vqueue serve`` with a fake-engine worker behind it, its own Redis, two tenants."""

    def __init__(
        self, url: str, keys: dict[str, str], api: Any, files: Path, redis_url: str
    ) -> None:
        self.url, self.keys, self.api, self.files = url, keys, api, files
        self.redis_url = redis_url

    def sdk(self, tenant: str) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.keys[tenant], max_retries=0)

    def batch(self, tenant: str, lines: list[dict[str, Any]], **create: Any) -> tuple[Any, str]:
        sdk = self.sdk(tenant)
        path = self.files / f"input-{tenant}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        with open(path, "rb") as fh:
            f = sdk.files.create(file=fh, purpose="batch")
        create.setdefault("endpoint", "/v1/vqueue/jobs")
        b = sdk.batches.create(input_file_id=f.id, completion_window="24h", **create)
        return sdk, b.id

    def post(self, path: str, headers: dict[str, str], body: list[bytes]) -> tuple[int, Any]:
        """A raw POST whose body is sent piece by piece (chunked when ``headers`` names no
        length), as far as the server reads it; then its answer."""
        import http.client
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.putrequest("POST", path)
        chunked = "Content-Length" not in headers
        for k, v in {"Authorization": f"Bearer {self.keys['a']}", **headers}.items():
            conn.putheader(k, v)
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        try:
            for piece in body:
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                conn.send(b"0\r\n\r\n")
        except OSError:  # the server answered before the body was all sent
            pass
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")


@pytest.fixture(scope="module")
def served(module_procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Served:
    tmp = tmp_path_factory.mktemp("served")
    server: RedisServer = module_procs.redis(tmp / "redis", aof=False)
    r = redis.Redis.from_url(server.url, decode_responses=True)
    # answers to "fake" and to another provider's name, as a worker set up for a file written
    # for that provider does
    w = module_procs.fake_worker("api", server.url, delay=0.05, concurrency=8, queue="full",
                                 VQUEUE_SERVED_MODEL_NAME="fake,gpt-4o-mini")  # fmt: skip
    w.wait_ready(r)
    keys = {t: _cli("keys", "create", t, url=server.url).stdout.decode().strip() for t in "ab"}
    port = free_port()
    env = worker_env(
        "full", VQUEUE_BROKER_URL=server.url, VQUEUE_FILES_DIR=str(tmp / "files"),
        VQUEUE_API_POLL_S="0.2", VQUEUE_SCHEMA_CHECK_MEMORY_MB="150",
        VQUEUE_MAX_FILE_BYTES=str(4 << 20), VQUEUE_API_MAX_BATCH_REQUESTS="100",
    )  # fmt: skip
    api = module_procs.popen(
        [sys.executable, "-m", "producer.cli", "serve", "--port", str(port)],
        cwd=WORKDIR, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _healthy(url), 60, "vqueue serve to answer /healthz")
    return Served(url, keys, api, tmp, server.url)


def _extract(i: int, schema: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"x{i}", "type": "extract", "text": "x", "json_schema": schema}


def test_hostile_schemas_fail_their_own_batch_and_the_server_lives(served: Served) -> None:
    # When tenant a sends the line that aborted the server, and one whose grammar is too big
    # for the server's 150 MiB per check
    billion = {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000_000}
    sdk_a, bad = served.batch("a", [_extract(0, billion), _extract(1, HUNGRY)])
    # and tenant b an ordinary batch
    ok_lines = [{"id": f"s{i}", "type": "summarize", "text": "hello"} for i in range(20)]
    ok_lines.append(_extract(99, PLAIN))
    sdk_b, ok = served.batch("b", ok_lines)
    # Then a's batch fails, each line saying why in one sentence; b's, its schema accepted, runs
    # to the end (the fake engine answers no JSON, so its extract line ends failed there)
    failed = _until(sdk_a, bad, ("failed", "completed"))
    assert failed.status == "failed", failed
    messages = {e.line: e.message for e in failed.errors.data}
    assert "maxItems=1000000000" in messages[1], messages
    assert "needs more than 150 MiB" in messages[2], messages
    assert all("Traceback" not in m and len(m) < 400 for m in messages.values())
    done = _until(sdk_b, ok, ("failed", "completed"))
    assert done.status == "completed" and done.request_counts.total == 21, done
    assert done.request_counts.completed == 20, done
    # and the server is up, its peak memory far from what the schemas asked for
    assert served.api.poll() is None and _healthy(served.url)
    assert _peak_rss_mb(served.api.pid) < 1024


def test_a_tenant_sees_neither_the_worker_nor_the_prefix_cache(served: Served) -> None:
    # Given a finished batch of tenant b's own jobs
    sdk, bid = served.batch("b", [{"id": "w", "type": "summarize", "text": "hello"}])
    done = _until(sdk, bid, ("completed", "failed"))
    # Then its results name no worker, and say nothing of what the engine had cached
    body = json.loads(sdk.files.content(done.output_file_id).text)["response"]["body"]
    assert body["status"] == "completed" and "worker" not in body
    assert "cached_tokens" not in body["usage"] and body["usage"]["prompt_tokens"] >= 0


def test_bodies_windows_and_metadata_are_bounded_as_openai_bounds_them(served: Served) -> None:
    sdk = served.sdk("a")
    path = served.files / "one.jsonl"
    path.write_text(json.dumps({"id": "m", "type": "summarize", "text": "x"}) + "\n")
    with open(path, "rb") as fh:
        f = sdk.files.create(file=fh, purpose="batch")
    create = {"input_file_id": f.id, "endpoint": "/v1/vqueue/jobs", "completion_window": "24h"}
    # A body over 1 MiB is refused before it is read when its length says so, and as it
    # arrives when it comes in chunks with no length
    json_type = {"Content-Type": "application/json"}
    code, answer = served.post("/v1/batches", {**json_type, "Content-Length": str(2 << 20)}, [])
    assert code == 413 and answer["error"]["code"] == "request_too_large", answer
    pieces = [b"x" * 65536] * 17  # 1 MiB and a piece
    assert served.post("/v1/batches", json_type, pieces)[0] == 413
    # and so is an upload past VQUEUE_MAX_FILE_BYTES (4 MiB here) sent in chunks
    boundary = "vqbound"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"f.jsonl\"\r\n\r\n").encode()  # fmt: skip
    form = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    assert served.post("/v1/files", form, [head, *[b"x" * 65536] * 66])[0] == 413
    # A window past 7 days, metadata past OpenAI's limits: 400 in OpenAI's shape, naming the field
    import openai

    for bad, param in (
        ({"completion_window": "999999999d"}, "completion_window"),
        ({"completion_window": "8d"}, "completion_window"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            sdk.batches.create(**{**create, **bad})
        assert err.value.body["param"] == param, err.value.body  # type: ignore[index]
        assert err.value.body["message"].startswith(param), err.value.body  # type: ignore[index]
    # /metrics answers at its own path, no redirect
    with urllib.request.urlopen(served.url + "/metrics", timeout=10) as resp:
        assert resp.status == 200 and resp.url.endswith("/metrics")


def _until(sdk: Any, bid: str, states: tuple[str, ...]) -> Any:
    return wait_for(
        lambda: (b := sdk.batches.retrieve(bid)).status in states and b, 120, f"{bid} to end"
    )


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
            return bool(json.loads(resp.read())["status"] == "ok")
    except OSError:
        return False


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_tenant_asks_for_no_more_priority_or_tokens_than_it_is_given(served: Served) -> None:
    # Given HTTP tenants' defaults: priority at most 8 (9 is urgent), max_tokens at most 8192
    lines = [
        {"id": "urgent", "type": "summarize", "text": "x", "priority": 9},
        {"id": "long", "type": "summarize", "text": "x", "max_tokens": 9000},
        {"id": "fine", "type": "summarize", "text": "x", "priority": 8, "max_tokens": 8192},
    ]
    # When a batch asks for more, Then its lines past either are refused, saying which
    sdk, bid = served.batch("a", lines)
    failed = _until(sdk, bid, ("failed", "completed"))
    assert failed.status == "failed"
    assert {e.line: e.message for e in failed.errors.data} == {
        1: "priority 9 is over this tenant's ceiling of 8",
        2: "max_tokens 9000 is over this tenant's 8192",
    }


def test_files_are_private_named_safely_and_a_deleted_input_fails_its_batch(
    served: Served,
) -> None:
    sdk = served.sdk("a")
    path = served.files / "evil.jsonl"
    path.write_text(json.dumps({"id": "p", "type": "summarize", "text": "x"}) + "\n")
    # Given an upload named to climb out of any directory
    with open(path, "rb") as fh:
        f = sdk.files.create(file=("../../../../etc/passwd", fh), purpose="batch")
    # Then its name is its last part alone, and it is kept readable by the server alone
    assert f.filename == "passwd"
    stored = served.files / "files" / f.id
    assert stored.stat().st_mode & 0o777 == 0o600
    assert stored.parent.stat().st_mode & 0o777 == 0o700
    # When its contents vanish from disk before a batch reads them
    stored.unlink()
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs", completion_window="1h")
    failed = _until(sdk, b.id, ("failed", "completed"))
    # Then the batch fails, saying so without a path
    assert failed.status == "failed"
    assert [(e.code, e.message) for e in failed.errors.data] == [
        ("file_not_found", "the input file was deleted")
    ]


def test_files_expire_when_asked_and_outputs_by_default(served: Served) -> None:
    from producer.http import ApiStore
    from schemas import Settings

    sdk = served.sdk("a")
    path = served.files / "brief.jsonl"
    path.write_text(json.dumps({"id": "e", "type": "summarize", "text": "x"}) + "\n")
    # Given an upload kept for an hour, as the openai SDK asks it
    with open(path, "rb") as fh:
        f = sdk.files.create(
            file=fh, purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
        )
    assert f.expires_at == f.created_at + 3600
    # and a batch over it whose output is kept two hours, and one that asks nothing
    kept = sdk.batches.create(
        input_file_id=f.id, endpoint="/v1/vqueue/jobs", completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )  # fmt: skip
    plain = sdk.batches.create(
        input_file_id=f.id, endpoint="/v1/vqueue/jobs", completion_window="24h"
    )
    kept_out = sdk.files.retrieve(_until(sdk, kept.id, ("completed",)).output_file_id)
    plain_out = sdk.files.retrieve(_until(sdk, plain.id, ("completed",)).output_file_id)
    # Then the outputs carry their expiry: two hours, and the server's 30 days by default
    assert kept_out.expires_at == kept_out.created_at + 7200
    assert plain_out.expires_at == plain_out.created_at + 30 * 24 * 3600
    # and an expiry OpenAI would refuse is refused, saying what it takes
    with open(path, "rb") as fh, pytest.raises(openai_error("BadRequestError")) as bad:
        sdk.files.create(
            file=fh, purpose="batch", expires_after={"anchor": "created_at", "seconds": 60}
        )
    assert "seconds from 3600 to 2592000" in str(bad.value)
    # When the server's sweep runs an hour and a minute later (driven here with a clock ahead)
    # (the store as the server holds it: its Redis, key prefix and files directory)
    r = redis.Redis.from_url(served.redis_url, decode_responses=True)
    settings = Settings(
        broker_url=served.redis_url, key_prefix=KEY_PREFIX, files_dir=str(served.files / "files")
    )
    usage = f"{KEY_PREFIX}:api:tenant:a:usage"
    held = int(r.hget(usage, "bytes") or 0)
    assert ApiStore(settings).expire(now=f.created_at + 3660) == 1
    # Then the upload is gone, record, bytes and disk; the outputs are kept
    ids = {x.id for x in sdk.files.list().data}
    assert f.id not in ids and {kept_out.id, plain_out.id} <= ids
    assert not (served.files / "files" / f.id).exists()
    assert int(r.hget(usage, "bytes") or 0) == held - f.bytes
    with pytest.raises(openai_error("NotFoundError")):
        sdk.files.retrieve(f.id)
    # and two hours on, the two-hour output goes too, while the 30-day one stays
    assert ApiStore(settings).expire(now=kept_out.created_at + 7260) == 1
    ids = {x.id for x in sdk.files.list().data}
    assert kept_out.id not in ids and plain_out.id in ids


def test_models_lists_what_live_workers_serve(served: Served) -> None:
    # Given a live worker serving its model as "fake" and "gpt-4o-mini", Then the SDK lists
    # both names, each once
    models = served.sdk("b").models.list()
    assert [m.id for m in models.data] == ["fake", "gpt-4o-mini"]
    assert models.data[0].object == "model" and models.data[0].created > 0


def test_an_openai_file_with_fields_vqueue_does_not_do_completes(served: Served) -> None:
    # Given a chat batch written as OpenAI's guide writes them: one plain request, one asking
    # for two choices, one for log probabilities, one with a tool that does not parse, one
    # naming a model the worker does not serve, one with a tool and tool_choice auto
    def req(cid: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "gpt-4o-mini", "user": "u", "max_completion_tokens": 8,
                         "messages": [{"role": "user", "content": "Hi"}], **body}}  # fmt: skip

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    lines = [req("plain", n=1, logprobs=False), req("two", n=2),
             req("lp", logprobs=True, top_logprobs=2), req("tool", tools=[{}]),
             req("other", model="llama-3-70b"), req("auto", tools=[tool], user="v")]  # fmt: skip
    sdk, bid = served.batch("a", lines, endpoint="/v1/chat/completions")
    # Then the batch completes: all answered but the tool that does not parse and the other
    # model, each failed alone
    done = _until(sdk, bid, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 2), done
    # with the 400 and 404 lines OpenAI writes, naming the field
    errors = {
        x["custom_id"]: x["response"]
        for x in map(json.loads, sdk.files.content(done.error_file_id).text.splitlines())
    }
    assert {k: (v["status_code"], v["body"]["error"]["param"]) for k, v in errors.items()} == {
        "tool": (400, "tools"), "other": (404, "model"),
    }  # fmt: skip
    assert errors["other"]["body"]["error"]["code"] == "model_not_found"
    # and the answers and the batch name the model by its first name, whichever one was asked
    answers = {
        x["custom_id"]: x["response"]["body"]
        for x in map(json.loads, sdk.files.content(done.output_file_id).text.splitlines())
    }
    assert [c["index"] for c in answers["two"]["choices"]] == [0, 1]
    assert answers["auto"]["choices"][0]["message"]["content"] == "stub output"
    assert len(answers["plain"]["choices"]) == 1
    assert answers["plain"]["choices"][0]["logprobs"] is None
    # the log probabilities in OpenAI's shape, two alternatives a token
    content = answers["lp"]["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == ["stub", " output"]
    assert all(len(t["top_logprobs"]) == 2 and t["bytes"] for t in content), content
    assert {a["model"] for a in answers.values()} == {"fake"} and done.model == "fake"
    plain, two = answers["plain"]["usage"], answers["two"]["usage"]
    # a request's usage counts its prompt once and every choice's tokens
    assert (plain["completion_tokens"], two["completion_tokens"]) == (2, 4), answers
    assert plain["prompt_tokens"] == two["prompt_tokens"] > 0
    assert done.usage.output_tokens == 10, done.usage
    assert done.usage.input_tokens == 4 * plain["prompt_tokens"], done.usage
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens


def test_a_completions_batch_answers_text_completions(served: Served) -> None:
    # Given a /v1/completions batch through the SDK: a plain prompt, one asking for logprobs,
    # one asking for an echo of its prompt, which vqueue does not do
    def req(cid: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
                "body": {"model": "gpt-4o-mini", "prompt": "Once upon a time", "max_tokens": 8,
                         **body}}  # fmt: skip

    lines = [req("plain"), req("lp", logprobs=1), req("echo", echo=True)]
    sdk, bid = served.batch("a", lines, endpoint="/v1/completions")
    # Then the batch completes, the echo failing alone with the 400 OpenAI writes
    done = _until(sdk, bid, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1), done
    (refused,) = map(json.loads, sdk.files.content(done.error_file_id).text.splitlines())
    assert refused["custom_id"] == "echo" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "echo"
    # and each answer is a text_completion, with the legacy logprobs where asked
    answers = {
        x["custom_id"]: x["response"]["body"]
        for x in map(json.loads, sdk.files.content(done.output_file_id).text.splitlines())
    }
    assert {a["object"] for a in answers.values()} == {"text_completion"}, answers
    assert answers["plain"]["choices"][0]["text"] == "stub output"
    assert answers["plain"]["choices"][0]["logprobs"] is None
    lp = answers["lp"]["choices"][0]["logprobs"]
    assert lp["tokens"] == ["stub", " output"] and lp["text_offset"] == [0, 4], lp
    assert all(len(alts) == 1 for alts in lp["top_logprobs"]), lp
    # and a chat line in a completions batch is refused at validation, naming both forms
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hi"}]}}  # fmt: skip
    sdk, bid = served.batch("a", [chat], endpoint="/v1/completions")
    bad = _until(sdk, bid, ("completed", "failed"))
    assert bad.status == "failed" and bad.errors is not None, bad
    assert "a /v1/chat/completions line in a batch for /v1/completions" in (
        bad.errors.data[0].message or ""
    ), bad.errors


def test_a_responses_batch_answers_response_objects(served: Served) -> None:
    # Given a /v1/responses batch through the SDK: a string input, message items, and one
    # continuing a stored response, which vqueue does not keep
    def req(cid: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": cid, "method": "POST", "url": "/v1/responses",
                "body": {"model": "gpt-4o-mini", "input": "Hi", "max_output_tokens": 8,
                         **body}}  # fmt: skip

    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    lines = [req("plain"), req("items", input=items, metadata={"k": "v"}),
             req("more", previous_response_id="resp_x")]  # fmt: skip
    sdk, bid = served.batch("a", lines, endpoint="/v1/responses")
    # Then the batch completes, the continuation failing alone with a 400 naming its field
    done = _until(sdk, bid, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1), done
    (refused,) = map(json.loads, sdk.files.content(done.error_file_id).text.splitlines())
    assert refused["response"]["body"]["error"]["param"] == "previous_response_id", refused
    # and each answer is a response object the SDK reads, metadata echoed
    from openai.types.responses import Response

    answers = {
        x["custom_id"]: Response.model_validate(x["response"]["body"])
        for x in map(json.loads, sdk.files.content(done.output_file_id).text.splitlines())
    }
    assert {k: a.output_text for k, a in answers.items()} == {
        "plain": "stub output", "items": "stub output"
    }  # fmt: skip
    assert answers["items"].metadata == {"k": "v"} and answers["plain"].model == "fake"


def test_a_file_of_more_requests_than_a_batch_takes_is_refused(served: Served) -> None:
    import openai

    # Given a server taking 100 requests a batch, and a file of 101
    sdk = served.sdk("a")
    path = served.files / "many.jsonl"
    path.write_text("".join(
        json.dumps({"id": f"m{i}", "type": "summarize", "text": "x"}) + "\n" for i in range(101)
    ))  # fmt: skip
    with open(path, "rb") as fh:
        f = sdk.files.create(file=fh, purpose="batch")
    # When a batch is made of it, Then it is refused at once, naming the limit and the setting
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs", completion_window="24h")
    assert refused.value.code == "too_many_requests"
    assert "more than 100 requests" in str(refused.value)
    assert "VQUEUE_API_MAX_BATCH_REQUESTS" in str(refused.value)


def openai_error(name: str) -> type[Exception]:
    import openai

    return getattr(openai, name)  # type: ignore[no-any-return]


def test_quotas_on_files_open_batches_and_open_jobs(module_procs: Procs, tmp_path: Path) -> None:
    import openai

    # Given a server with small quotas and no worker (so batches stay open)
    server: RedisServer = module_procs.redis(tmp_path / "redis", aof=False)
    key = _cli("keys", "create", "c", url=server.url).stdout.decode().strip()
    port = free_port()
    env = worker_env(
        "tight", VQUEUE_BROKER_URL=server.url, VQUEUE_FILES_DIR=str(tmp_path / "files"),
        VQUEUE_API_POLL_S="0.2", VQUEUE_API_MAX_FILES="3", VQUEUE_API_MAX_OPEN_BATCHES="2",
        VQUEUE_API_MAX_OPEN_JOBS="5",
    )  # fmt: skip
    module_procs.popen(
        [sys.executable, "-m", "producer.cli", "serve", "--port", str(port)],
        cwd=WORKDIR, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _healthy(url), 60, "vqueue serve to answer /healthz")
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)

    def upload(n: int) -> Any:
        path = tmp_path / f"in{n}.jsonl"
        lines = [{"id": f"j{i}", "type": "summarize", "text": "x"} for i in range(n)]
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        with open(path, "rb") as fh:
            return sdk.files.create(file=fh, purpose="batch")

    def batch(f: Any) -> Any:
        return sdk.batches.create(
            input_file_id=f.id, endpoint="/v1/vqueue/jobs", completion_window="24h"
        )

    two, four = upload(2), upload(4)
    # When a batch of 2 jobs is open, Then one of 4 more would pass the 5 open jobs: it fails
    assert _until(sdk, batch(two).id, ("in_progress",)).status == "in_progress"
    over = _until(sdk, batch(four).id, ("failed", "in_progress"))
    assert over.status == "failed" and over.errors.data[0].code == "quota_exceeded", over
    # and with a second batch open, a third is refused at once (429)
    assert _until(sdk, batch(two).id, ("in_progress",)).status == "in_progress"
    with pytest.raises(openai.RateLimitError, match="batches not ended"):
        batch(two)
    # and past 3 files kept, an upload is refused likewise
    upload(1)
    with pytest.raises(openai.RateLimitError, match="keeps 3 files"):
        upload(1)


@pytest.mark.parametrize("name", ["", "a b", "x@y", "vqueue.urgent", "*", "q:9"])
def test_a_queue_name_that_could_reach_another_queue_is_refused(name: str) -> None:
    # `<queue>.urgent`, `<queue>@<worker>` and `<queue>:<step>` are other queues' lists; the
    # error names the option the name came in, and (where it is the pattern) the rule in words
    proc = run_cli("--queue", name, "status", "nobatch", timeout=60)
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and "--queue: " in stderr and "[A-Za-z" not in stderr, stderr
    env = run_cli("status", "nobatch", timeout=60, VQUEUE_QUEUE=name).stderr.decode()
    assert "VQUEUE_QUEUE: " in env, env
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


# --------------------------------------------------------------------- feeds that lose a server
def _serve(procs: Procs, url: str, files: Path, **env: str) -> tuple[Any, str, Path]:
    """A ``vqueue serve`` on Redis ``url``: (its process, its URL, its log)."""
    port = free_port()
    settings = worker_env(
        "feed", VQUEUE_BROKER_URL=url, VQUEUE_FILES_DIR=str(files), VQUEUE_API_POLL_S="0.2",
        **{"VQUEUE_API_FEED_LEASE_S": "3", **env},
    )  # fmt: skip
    log = files.parent / f"serve-{port}.log"
    with open(log, "w") as out:
        proc = procs.popen(
            [sys.executable, "-m", "producer.cli", "serve", "--port", str(port)],
            cwd=WORKDIR, env=settings, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _healthy(base), 60, "vqueue serve to answer /healthz")
    return proc, base, log


def _fed(r: redis.Redis, bid: str) -> int:
    from .conftest import KEY_PREFIX

    return int(r.hget(f"{KEY_PREFIX}:batch:{bid}", "fed") or 0)


def test_a_feed_resumes_where_it_stopped_when_its_server_dies(procs: Procs, tmp_path: Path) -> None:
    import openai

    from .conftest import KEY_PREFIX

    # Given a worker (fake engine), and a server feeding a 3,000-job batch 100 jobs ahead of it
    server: RedisServer = procs.redis(tmp_path / "redis", aof=False)
    r = redis.Redis.from_url(server.url, decode_responses=True)
    procs.fake_worker("feed", server.url, delay=0.02, concurrency=16, queue="feed").wait_ready(r)
    key = run_cli("keys", "create", "f", VQUEUE_BROKER_URL=server.url).stdout.decode().strip()
    first, url, _ = _serve(procs, server.url, tmp_path / "files", VQUEUE_MAX_QUEUE_DEPTH="100")
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    n = 3000
    path = tmp_path / "big.jsonl"
    path.write_text("".join(
        json.dumps({"id": f"j{i:05d}", "type": "summarize", "text": f"doc {i}"}) + "\n"
        for i in range(n)
    ))  # fmt: skip
    with open(path, "rb") as fh:
        f = sdk.files.create(file=fh, purpose="batch")
    bid = sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                             completion_window="24h").id  # fmt: skip
    # When the server is killed (-9) a few hundred jobs into the feed, and another started
    wait_for(lambda: _fed(r, bid) >= 300, 120, "the feed to pass 300 jobs")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    stopped_at = _fed(r, bid)
    assert stopped_at < n
    _, url, _ = _serve(procs, server.url, tmp_path / "files", VQUEUE_MAX_QUEUE_DEPTH="100")
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    # Then the new server resumes the feed after the lease lapses, from where it stopped: the
    # batch completes, every job delivered once and answered once
    done = wait_for(
        lambda: (b := sdk.batches.retrieve(bid)).status in ("completed", "failed") and b,
        300, "the resumed batch to end",
    )  # fmt: skip
    assert done.status == "completed" and done.request_counts.completed == n, done
    # the results left Redis for the output file as they came: one line for each job there
    assert r.xlen(f"{KEY_PREFIX}:batch:{bid}:results") == 0
    lines = sdk.files.content(done.output_file_id).text.splitlines()
    ids = Counter(json.loads(x)["custom_id"] for x in lines)
    assert len(ids) == n and max(ids.values()) == 1, ids.most_common(3)

    # and no job was delivered again after its result (its delivery count goes with the result)
    assert not r.exists(f"{KEY_PREFIX}:batch:{bid}:attempts")


def test_a_feed_stops_when_its_batch_leaves_redis(procs: Procs, tmp_path: Path) -> None:
    import openai

    # Given a server feeding a batch with no worker, so that it waits for room in the queue
    # (its first chunk of 32 queued, the next 50 not admitted under a depth of 50); its lease
    # is renewed every 3 s, so it learns of a flush mostly while it waits for room again
    server: RedisServer = procs.redis(tmp_path / "redis", aof=False)
    r = redis.Redis.from_url(server.url, decode_responses=True)
    key = run_cli("keys", "create", "f", VQUEUE_BROKER_URL=server.url).stdout.decode().strip()
    _, url, log = _serve(
        procs, server.url, tmp_path / "files", VQUEUE_MAX_QUEUE_DEPTH="50",
        VQUEUE_API_FEED_LEASE_S="9",
    )  # fmt: skip
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"type": "summarize", "text": "x"}) + "\n"
                            for _ in range(500)))  # fmt: skip
    with open(path, "rb") as fh:
        f = sdk.files.create(file=fh, purpose="batch")
    sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs", completion_window="24h")
    from protocol.wire import queue_depth  # jobs, a pack counted by what it carries

    wait_for(lambda: queue_depth(r, "feed") == 32, 60, "the feed's first chunk in the queue")
    # When Redis is flushed under it, which also makes room in the queue
    r.flushall()
    # Then the feed sees its batch gone and stops, having queued at most the chunk it held,
    # whether it learns of it between two lines or while it waits for room
    wait_for(lambda: "left Redis while it was fed" in log.read_text(), 30, "the feed to stop")
    assert queue_depth(r, "feed") <= 50


def test_expiry_and_cancel_end_their_batches_with_no_worker(procs: Procs, tmp_path: Path) -> None:
    import openai

    # Given a server whose queue no worker consumes, and two 1,500-job batches (more ids than
    # one page of the server's scan): one with a 5-second window, one to cancel
    server: RedisServer = procs.redis(tmp_path / "redis", aof=False)
    key = run_cli("keys", "create", "n", VQUEUE_BROKER_URL=server.url).stdout.decode().strip()
    _, url, _ = _serve(procs, server.url, tmp_path / "files")
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(
        json.dumps({"id": f"j{i}", "type": "summarize", "text": f"doc {i}"}) + "\n"
        for i in range(1500)
    ))  # fmt: skip
    with open(path, "rb") as fh:
        f = sdk.files.create(file=fh, purpose="batch")
    short = sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                               completion_window="5s")  # fmt: skip
    to_cancel = sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs",
                                   completion_window="24h")  # fmt: skip
    _until(sdk, to_cancel.id, ("in_progress",))
    # When the window passes, and the other is cancelled
    sdk.batches.cancel(to_cancel.id)
    # Then both end on time, each job failed with the reason, in the error file
    for bid, state in ((short.id, "expired"), (to_cancel.id, "cancelled")):
        b = _until(sdk, bid, ("expired", "cancelled", "completed", "failed"))
        assert b.status == state, b
        assert b.request_counts.total == 1500 and b.request_counts.failed == 1500, b
        lines = [json.loads(x) for x in sdk.files.content(b.error_file_id).text.splitlines()]
        assert len(lines) == 1500 and {x["error"]["code"] for x in lines} == {state}
    assert time.time() < short.expires_at + 30


@pytest.mark.unit
def test_a_check_that_cannot_start_refuses_the_schema_and_is_not_remembered() -> None:
    # Given checks whose child has too little memory to import llguidance at all
    checker = Checker(Limits(memory_bytes=8 << 20))
    text = json.dumps(PLAIN)
    try:
        # When a schema is checked, Then it is refused, saying the check cannot run here (not
        # blaming the schema's memory)
        answer = checker.problem(text)
        assert answer is not None and answer.startswith("json_schema cannot be checked here"), (
            answer
        )
        # and once checks can run, the same schema passes: the refusal was not its answer
        checker.limits = Limits()
        assert checker.problem(text) is None
    finally:
        checker.close()


def test_two_servers_never_both_hold_a_batchs_feed_or_its_lock() -> None:
    import uuid

    from redis.exceptions import LockError

    from producer.http import ApiStore

    from .conftest import KEY_PREFIX, make_settings

    # Given two server processes' stores on one Redis, and a batch there
    settings = make_settings(key_prefix=f"{KEY_PREFIX}-lease-{uuid.uuid4().hex[:6]}")
    one, two = ApiStore(settings), ApiStore(settings)
    one.r.hset(f"{one.p}:batch:b1", "total", 0)

    # When the first holds the feed for twice its lease's length (renewed as it runs)
    first_feed = one.feed("b1", ttl_s=0.6)
    first = first_feed.__enter__()
    assert first is not None
    until = time.monotonic() + 1.2
    while time.monotonic() < until:
        assert one.feeding("b1") and not first.is_set()
        with two.feed("b1", ttl_s=0.6) as second:
            assert second is None  # Then the second never gets it
        time.sleep(0.1)
    # When the first one's lease lapses (its process stalled) and the second takes it
    one.r.pexpire(f"{one.p}:feed:b1", 1)
    wait_for(lambda: not one.feeding("b1"), 5, "the lapse")
    second_feed = two.feed("b1", ttl_s=30)
    assert second_feed.__enter__() is not None
    # Then the first is told to stop, and its leaving leaves the second's lease alone
    wait_for(first.is_set, 5, "the first feed told its lease is gone")
    first_feed.__exit__(None, None, None)
    assert one.feeding("b1")
    second_feed.__exit__(None, None, None)
    assert not one.feeding("b1")

    # The batch's lock: one holder; a holder whose lease lapsed cannot renew the next one's
    with one.lock("b1", ttl_s=30) as mine:
        assert mine is not None
        with two.lock("b1") as theirs:
            assert theirs is None
        one.r.pexpire(f"{one.p}:lock:b1", 1)
        wait_for(lambda: not one.r.exists(f"{one.p}:lock:b1"), 5, "the lapse")
        with two.lock("b1") as theirs:
            assert theirs is not None
            with pytest.raises(LockError):
                mine.reacquire()
        assert not one.r.exists(f"{one.p}:lock:b1")  # the second gave its own back
