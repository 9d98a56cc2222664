"""README's command-line promises, each through the real ``vqueue`` command against a Redis of
this module's own and one real worker process on the FAKE engine (``tests/fake_engine.py``):
what is under test is the command's behaviour, output and exit code, not generation."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from protocol.exits import RET_NOT_FOUND, RET_TIMEOUT

from .conftest import Procs, RedisServer, WorkerProc, run_cli

Q = "cli"


class Cli:
    def __init__(self, url: str, worker: WorkerProc) -> None:
        self.url, self.worker = url, worker

    def __call__(self, *args: str, queue: str = Q, **env: str) -> Any:
        """``vqueue ARGS`` on this module's Redis: its ``subprocess.CompletedProcess``."""
        return run_cli(*args, queue=queue, timeout=300, VQUEUE_BROKER_URL=self.url, **env)


@pytest.fixture(scope="module")
def cli(module_procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Cli:
    server: RedisServer = module_procs.redis(tmp_path_factory.mktemp("cli") / "redis", aof=False)
    w = module_procs.fake_worker("cli", server.url, delay=0.05, concurrency=8, queue=Q)
    w.wait_ready(redis.Redis.from_url(server.url, decode_responses=True))
    return Cli(server.url, w)


def _jobs(path: Path, n: int, **extra: Any) -> Path:
    lines = [{"id": f"j{i}", "type": "summarize", "text": f"text {i}", **extra} for i in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_ping_answers_by_exit_code(cli: Cli) -> None:
    # a live worker on the queue: 0; none on another queue: 6 once its timeout passes
    assert cli("ping").returncode == 0
    nobody = cli("ping", "--timeout", "1", queue="nobody-listens")
    assert nobody.returncode == RET_TIMEOUT and b"0 live worker(s)" in nobody.stderr


def test_waiting_past_timeout_exits_6_and_the_jobs_stay(cli: Cli, tmp_path: Path) -> None:
    # Given jobs on a queue no worker consumes, When submit waits with --timeout
    proc = cli("submit", str(_jobs(tmp_path / "j.jsonl", 3)), "--wait", "--timeout", "2", "-q",
               queue="unconsumed")  # fmt: skip
    # Then it gives up with exit 6, having printed the batch id, the jobs still queued
    assert proc.returncode == RET_TIMEOUT, proc.stderr
    batch = proc.stdout.decode().split()[0]
    status = json.loads(cli("status", batch, "--json", queue="unconsumed").stdout)
    assert status["total"] == 3 and status["remaining"] == 3


def test_priority_resubmission_force_and_results_files(cli: Cli, tmp_path: Path) -> None:
    src = _jobs(tmp_path / "j.jsonl", 4)
    # Given a batch run to its end at --priority 7
    first = cli("submit", str(src), "--wait", "--priority", "7", "-q", "--json")
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout.decode().splitlines()[-1])
    batch = summary["batch"]
    assert (summary["enqueued"], summary["completed"]) == (4, 4)
    # When the same file is submitted again into the batch, Then nothing is sent twice
    again = cli("submit", str(src), "--batch", batch, "-q")
    assert again.returncode == 0 and b"4 job(s) skipped" in again.stderr, again.stderr
    # and with --force every job runs again, each still with one result
    forced = cli("submit", str(src), "--batch", batch, "--force", "--wait", "-q")
    assert forced.returncode == 0, forced.stderr
    # Then results --out/--errors split completed from failed, and --table shows each job
    out, errs = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    assert cli("results", batch, "--out", str(out), "--errors", str(errs)).returncode == 0
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == [
        "j0", "j1", "j2", "j3"
    ]  # fmt: skip
    assert errs.read_text() == ""
    table = cli("results", batch, "--table").stdout.decode()
    assert all(f"j{i}" in table for i in range(4))


def test_a_job_at_priority_seven_waits_in_its_priority_list(cli: Cli, tmp_path: Path) -> None:
    # kombu's Redis transport keeps one list per priority step, consumed lowest step first:
    # priority 7 is step 2
    proc = cli("submit", str(_jobs(tmp_path / "j.jsonl", 2)), "--priority", "7", "-q",
               queue="parked")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = redis.Redis.from_url(cli.url)
    from protocol.wire import queue_depth

    assert r.llen("parked:2") >= 1 and r.llen("parked") == 0  # one pack, or one a job
    assert queue_depth(r, "parked") == 2


def test_templates_show_and_schema_kinds(cli: Cli) -> None:
    shown = cli("templates", "show", "contact")
    assert shown.returncode == 0 and json.loads(shown.stdout)["name"] == "contact"
    missing = cli("templates", "show", "no-such-template")
    assert missing.returncode == RET_NOT_FOUND and b"no template" in missing.stderr
    for kind, key in (("result", "status"), ("openai", "messages"),
                      ("openai-completions", "best_of"), ("openai-responses", "instructions"),
                      ("job", "discriminator")):  # fmt: skip
        out = cli("schema", "--kind", kind)
        assert out.returncode == 0 and key in out.stdout.decode(), kind


def test_keys_are_revoked(cli: Cli) -> None:
    key = cli("keys", "create", "gone-tenant").stdout.decode().strip()
    assert key.startswith("vq-")
    revoked = cli("keys", "revoke", "gone-tenant")
    assert revoked.returncode == 0 and b"revoked 1 key(s)" in revoked.stdout
    assert cli("keys", "revoke", "gone-tenant").returncode == RET_NOT_FOUND
    from producer.http import ApiStore
    from schemas import Settings

    store = ApiStore(Settings(_env_file=None, broker_url=cli.url, key_prefix=_prefix()))
    assert store.tenant_of(key) is None


def _prefix() -> str:
    from .conftest import KEY_PREFIX

    return KEY_PREFIX


def test_a_hand_made_message_the_worker_cannot_read_fails_as_invalid_job(cli: Cli) -> None:
    # Given a Celery message written by hand, past every producer check: a job of no known type
    from protocol.wire import task_message
    from schemas import Envelope, SummarizeJob

    env = Envelope(job=SummarizeJob(id="odd", type="summarize", text="x"), batch="handmade",
                   enqueued_at=0.0)  # fmt: skip
    key, raw = task_message(env, Q)
    message = json.loads(raw)
    body = json.loads(message["body"])
    body[0][0]["job"]["type"] = "translate"
    message["body"] = json.dumps(body)
    r = redis.Redis.from_url(cli.url, decode_responses=True)
    r.lpush(key, json.dumps(message))
    # Then the worker records it failed as invalid_job, under its batch, and carries on
    stream = f"{_prefix()}:batch:handmade:results"

    def recorded() -> Any:
        entries = r.xrange(stream)
        return entries and json.loads(entries[0][1]["result"])

    from .conftest import wait_for

    result = wait_for(recorded, 60, "the hand-made job's result")
    assert result["id"] == "odd" and result["error"]["type"] == "invalid_job", result
    assert cli("ping").returncode == 0


def test_bad_paths_and_urls_fail_before_anything_is_enqueued(cli: Cli, tmp_path: Path) -> None:
    src = _jobs(tmp_path / "j.jsonl", 2)
    # an --out that cannot be written: one line, exit 2, and no batch made
    r = redis.Redis.from_url(cli.url)
    before = len(r.keys(f"{_prefix()}:batch:*"))
    proc = cli("submit", str(src), "--wait", "--out", "/nonexistent/dir/r.jsonl", queue="paths")
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and "cannot write --out" in stderr and "Traceback" not in stderr
    assert len(r.keys(f"{_prefix()}:batch:*")) == before and r.llen("paths") == 0
    # a broker URL that is not Redis's: one line, exit 2, no password echoed
    bad = cli("--broker", "http://user:secret@host", "submit", str(src))
    stderr = bad.stderr.decode()
    assert bad.returncode == 2 and "--broker: must be a Redis URL" in stderr, stderr
    assert "secret" not in stderr and "Traceback" not in stderr
    # nor one without a scheme, which reads as the value given, nor a queue no name can be: each
    # names the option that carried it, in words, not a regex
    bad = cli("--broker", "user:secret@notaurl", "status").stderr.decode()
    assert "not 'notaurl', which names no scheme" in bad and "secret" not in bad, bad
    empty = cli("--queue", "", "status")
    assert empty.returncode == 2, empty.stderr
    assert b"--queue: must be 1 to 128 letters, digits" in empty.stderr, empty.stderr
    assert b"[A-Za-z" not in empty.stderr


def test_a_submit_no_worker_will_take_says_so(cli: Cli, tmp_path: Path) -> None:
    proc = cli("submit", str(_jobs(tmp_path / "j.jsonl", 1)), "-q", queue="nobody-here")
    assert proc.returncode == 0
    assert b"no live worker consumes queue 'nobody-here'" in proc.stderr, proc.stderr


def test_ctrl_c_while_waiting_exits_130_and_says_how_to_wait_again(
    cli: Cli, tmp_path: Path
) -> None:
    import signal
    import sys

    from .conftest import WORKDIR, wait_for, worker_env

    # Given a submit waiting on jobs no worker takes
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "submit", str(_jobs(tmp_path / "j.jsonl", 2)),
         "--wait", "-q"],
        cwd=WORKDIR, env=worker_env("waits-forever", VQUEUE_BROKER_URL=cli.url),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # as from a terminal: a SIGINT this test process ignores (some library it imported may
        # have set that) would be ignored by the child too, and Python would never raise
        # KeyboardInterrupt there
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    batch = wait_for(lambda: proc.stdout.readline().decode().strip(), 60, "the batch id")  # type: ignore[union-attr]
    # When it is interrupted, Then it exits 130, naming the command that waits again
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert f"vqueue results {batch} --wait" in err.decode() and b"Traceback" not in err


def test_a_feed_killed_mid_input_resumes_where_it_stopped_each_job_once(
    cli: Cli, procs: Procs, tmp_path: Path
) -> None:
    import sys
    import threading
    import time

    from .conftest import KEY_PREFIX, WORKDIR, kill_group, wait_for, worker_env

    r = redis.Redis.from_url(cli.url, decode_responses=True)
    src, batch, window = _jobs(tmp_path / "big.jsonl", 150), "fedtwice", 20
    env = worker_env("feed", VQUEUE_BROKER_URL=cli.url, VQUEUE_FEED_WINDOW=str(window))
    # Given an input bigger than its window, fed into a queue no worker consumes yet
    feeder = procs.popen(
        [sys.executable, "-m", "producer.cli", "submit", str(src), "--batch", batch, "-q"],
        cwd=WORKDIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip

    def status() -> dict[str, Any]:  # {} until the feed has made the batch
        proc = cli("status", batch, "--json", queue="feed")
        return json.loads(proc.stdout) if proc.returncode == 0 else {}

    wait_for(lambda: (status().get("fed") or 0) >= window // 2, 60, "the first chunks")
    time.sleep(1)
    # Then the window holds: the feed waits with the rest of the input unsent
    held = status()
    assert held["total"] <= window and held["fed"] == held["total"], held
    assert feeder.poll() is None
    # When the feeding process is killed, a worker starts, and the same input is submitted
    # again into the batch, following it to the end and taking its results out of Redis
    kill_group(feeder)
    assert "its feed stopped" in cli("status", batch, queue="feed").stdout.decode()
    w = procs.fake_worker("feed", cli.url, delay=0.01, concurrency=8, queue="feed")
    w.wait_ready(r, timeout=120)
    out = tmp_path / "out.jsonl"
    peak = [0]
    watching = threading.Event()

    def watch() -> None:  # the batch's jobs in Redis, sampled while the resumed feed runs
        while not watching.is_set():
            h = r.hmget(f"{KEY_PREFIX}:batch:{batch}", "total", "completed",
                        "failed")  # fmt: skip
            peak[0] = max(peak[0], int(h[0] or 0) - int(h[1] or 0) - int(h[2] or 0))
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()
    again = cli("submit", str(src), "--batch", batch, "--wait", "--out", str(out), "--take",
                "-q", queue="feed", VQUEUE_FEED_WINDOW=str(window))  # fmt: skip
    watching.set()
    # Then it resumes after the jobs sent, every job runs once, and the window held throughout
    assert again.returncode == 0, again.stderr
    assert f"resuming its feed after the {held['fed']} jobs already sent" in again.stderr.decode()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["id"] for x in lines) == sorted(f"j{i}" for i in range(150))
    prefix = KEY_PREFIX
    assert {x["deliveries"] for x in lines} == {1}  # one delivery each,
    assert not r.exists(f"{prefix}:batch:{batch}:attempts")  # and none after a job's result
    assert 0 < peak[0] <= window
    # and the results left Redis once written, the counts staying
    assert r.xlen(f"{prefix}:batch:{batch}:results") == 0
    final = status()
    assert (final["total"], final["completed"], final["fed"]) == (150, 150, None)
    # each result names its input line, and what the batch's jobs leave in Redis is a bit a
    # line: no mark under any id, none open
    assert all(x["line"] == int(x["id"][1:]) + 1 for x in lines)
    assert set(r.scan_iter(f"{prefix}:batch:{batch}:done*")) == {
        f"{prefix}:batch:{batch}:done:lines"
    }
    assert r.bitcount(f"{prefix}:batch:{batch}:done:lines") == 150


def test_a_taking_reader_killed_and_started_again_writes_each_result_once(
    cli: Cli, procs: Procs, tmp_path: Path
) -> None:
    import sys

    from .conftest import KEY_PREFIX, WORKDIR, kill_group, wait_for, worker_env

    r = redis.Redis.from_url(cli.url, decode_responses=True)
    # Given a batch of 400 jobs running on the module's worker (about 160 jobs/s)
    sub = cli("submit", str(_jobs(tmp_path / "j.jsonl", 400)), "-q")
    assert sub.returncode == 0, sub.stderr
    batch = sub.stdout.decode().split()[0]
    out = tmp_path / "out.jsonl"
    take = ["results", batch, "--wait", "--out", str(out), "--take"]
    # When a reader taking its results into a file is killed part way
    reader = procs.popen([sys.executable, "-m", "producer.cli", *take], cwd=WORKDIR,
                         env=worker_env(Q, VQUEUE_BROKER_URL=cli.url))  # fmt: skip
    lines = lambda: out.read_text().count("\n") if out.exists() else 0  # noqa: E731
    wait_for(lambda: lines() >= 100, 60, "a hundred results written")
    kill_group(reader)
    assert 0 < lines() < 400
    # and started again on the same file
    again = cli(*take)
    # Then the file holds every result once, and none is left in Redis
    assert again.returncode == 0, again.stderr
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"j{i}" for i in range(400))
    assert r.xlen(f"{KEY_PREFIX}:batch:{batch}:results") == 0


@pytest.mark.unit
def test_the_results_table_stays_aligned_with_wide_characters() -> None:
    from producer.cli.read import _cells, render_table
    from schemas import JobResult, Timings

    rows = [
        JobResult(
            id=ident,
            batch="b",
            type="summarize",
            status="completed",
            text=text,
            timings=Timings(enqueued_at=0.0, finished_at=1.0),
        )  # fmt: skip
        for ident, text in (("ascii", "plain words " * 20), ("摘要-一", "注意防范山洪" * 30))
    ]
    lines = render_table(rows).splitlines()[2:]
    # every column starts at the same terminal cell, and no line passes the table's width
    starts = [_cells(line.split("completed")[0]) for line in lines]
    assert starts[0] == starts[1], lines
    assert len({_cells(line) for line in lines}) == 1 or max(_cells(x) for x in lines) <= 110


@pytest.mark.unit
@pytest.mark.parametrize(
    ("module", "args", "hidden", "code", "says"),
    [
        ("producer.cli", ["serve"], "uvicorn", 2, "the HTTP API needs the server extra"),
        ("worker", [], "vllm", 10, "this worker cannot run: vllm is not installed"),
    ],
)
def test_a_missing_extra_is_one_line_and_its_exit_code(
    module: str, args: list[str], hidden: str, code: int, says: str
) -> None:
    # Given an install without the package an extra brings (None in sys.modules reads, to
    # import and to importlib's find_spec, as not installed)
    import sys

    run = (
        f"import runpy, sys; sys.modules[{hidden!r}] = None; sys.argv[1:] = {args!r}; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    # When the command that needs it runs
    proc = subprocess.run([sys.executable, "-c", run], capture_output=True, timeout=120)
    # Then it says so in one line, names the extra, and exits with its documented code
    stderr = proc.stderr.decode()
    assert proc.returncode == code, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("vqueue: ") and says in stderr, stderr
    assert "pip install 'vqueue[" in stderr and "Traceback" not in stderr


def test_the_progress_bar_on_a_terminal_knows_its_total_as_the_feed_grows(
    cli: Cli, tmp_path: Path
) -> None:
    # Given an input five times the batch's feed window, submitted with --wait on a terminal
    import fcntl
    import os
    import pty
    import struct
    import sys
    import termios

    from .conftest import WORKDIR, worker_env

    src = _jobs(tmp_path / "j.jsonl", 80)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = worker_env(Q, VQUEUE_BROKER_URL=cli.url, VQUEUE_FEED_WINDOW="16")
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "submit", str(src), "--wait"],
                            cwd=WORKDIR, env=env, stdin=follower, stdout=follower,
                            stderr=follower)  # fmt: skip
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the command ended
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=300) == 0, seen[-2000:]
    os.close(leader)
    # Then its bars are drawn, each count beside a known total, the last one the whole input's
    text = seen.decode(errors="replace")
    counts = [x.split("|")[0].split()[-1] for x in text.replace("\r", "\n").split("\n")
              if x.startswith("done: ")]  # fmt: skip
    assert counts and all("None" not in c for c in counts), counts
    assert counts[-1] == "80/80", counts[-5:]
