"""Codegen answers run against their tests in the bubblewrap sandbox (worker/sandbox.py): a right
answer passes, a wrong one fails with its error line, and hostile code is stopped and reported
while the worker process that ran it goes on (real bwrap, real interpreter; no engine)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from schemas import Settings
from worker.sandbox import run_tests, sandbox_problem

from .conftest import require, wait_for

LIMITS = Settings(test_timeout_s=3, test_memory_mb=256, test_output_bytes=16384)
ADD = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module", autouse=True)
def _sandbox() -> None:
    require("bwrap")
    require("prlimit")
    assert sandbox_problem() is None, sandbox_problem()


@pytest.mark.parametrize(
    ("code", "tests", "entry_point"),
    [
        (ADD, "assert add(2, 3) == 5", None),
        (ADD, "from solution import add as plus\nassert plus(1, 1) == 2", None),
        (ADD, "def check(candidate):\n    assert candidate(2, 2) == 4", "add"),
    ],
)  # fmt: skip
def test_a_right_answer_passes_its_tests(code: str, tests: str, entry_point: str | None) -> None:
    run = run_tests(code, tests, entry_point, LIMITS)
    assert (run.outcome, run.detail) == ("passed", None), run


def test_a_wrong_answer_fails_with_its_error_line() -> None:
    run = run_tests(ADD.replace("+", "-"), "assert add(2, 3) == 5, 'add(2, 3) is 5'", None, LIMITS)
    assert run.outcome == "failed" and run.detail, run
    assert run.detail.startswith("AssertionError: add(2, 3) is 5 in `assert add(2, 3) =="), run
    # and a bare assert names the line that failed, not only AssertionError
    bare = run_tests(ADD.replace("+", "-"), "assert add(2, 3) == 5", None, LIMITS)
    assert bare.detail == "AssertionError in `assert add(2, 3) == 5`", bare
    broken = run_tests("def add(a, b:\n    pass", "assert add(1, 1) == 2", None, LIMITS)
    assert broken.outcome == "failed" and broken.detail.startswith("SyntaxError"), broken


@pytest.mark.parametrize(
    ("code", "outcome", "detail"),
    [
        ("while True:\n    pass", "timed_out", "still running after 3 s"),
        ("import time\ntime.sleep(60)", "timed_out", "still running after 3 s"),
        ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
         "timed_out", "still running after 3 s"),
        ("x = []\nwhile True:\n    x.append(bytearray(1 << 20))", "failed", "MemoryError"),
        ("while True:\n    print('x' * 1000)", "killed", "its output passed the limit"),
        ("open('/etc/vqueue-was-here', 'w')", "failed", "Read-only file system|Permission denied"),
        ("open('/usr/vqueue-was-here', 'w')", "failed", "Read-only file system|Permission denied"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=2)", "failed",
         "Connection refused"),
        ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)", "failed",
         "Network is unreachable"),
        ("import os\nos.listdir(" + repr(str(Path(__file__).parent)) + ")", "failed",
         "No such file or directory"),
    ],
    ids=["spins", "sleeps", "forks", "allocates", "floods", "writes-etc", "writes-usr",
         "reaches-redis", "reaches-out", "reads-project"],
)  # fmt: skip
def test_hostile_code_is_stopped_and_reported(code: str, outcome: str, detail: str) -> None:
    started = time.monotonic()
    run = run_tests(code, "pass", None, LIMITS)
    assert run.outcome == outcome and re.search(detail, run.detail or ""), run
    assert time.monotonic() - started < LIMITS.test_timeout_s + 5

    # and nothing it started outlives it (the kernel ends the sandbox's process namespace with
    # it, at once but not in the same instant), nor anything it wrote
    def gone() -> bool:
        left = subprocess.run(["pgrep", "-f", "program.py"], capture_output=True, text=True)
        return left.stdout.strip() == ""

    wait_for(gone, 10, "the sandbox's processes to end")
    assert not os.path.exists("/etc/vqueue-was-here") and not os.path.exists("/usr/vqueue-was-here")


def test_tests_are_refused_for_languages_without_a_runner() -> None:
    from pydantic import ValidationError

    from schemas import CodegenJob

    job = CodegenJob(type="codegen", instruction="x", tests="assert True", entry_point="f")
    assert job.max_attempts == 3
    with pytest.raises(ValidationError, match="tests run for Python answers only"):
        CodegenJob(type="codegen", instruction="x", language="rust", tests="assert!(true);")
    with pytest.raises(ValidationError, match="it needs tests"):
        CodegenJob(type="codegen", instruction="x", entry_point="f")


def test_a_host_without_bubblewrap_runs_no_tests(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Given a worker whose PATH has no bwrap
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox_problem.cache_clear()
    try:
        # Then it says why, and runs nothing: a job with tests fails sandbox_unavailable
        assert "bwrap is not installed" in (sandbox_problem() or "")
        with pytest.raises(RuntimeError, match="bwrap is not installed"):
            run_tests(ADD, "assert add(1, 1) == 2", None, LIMITS)
        # and when bubblewrap turns up (PATH again), a running worker takes it at its next
        # look, unrestarted
        monkeypatch.undo()
        monkeypatch.setattr(sandbox_problem, "recheck_s", 0.0)
        assert sandbox_problem() is None
    finally:
        monkeypatch.undo()
        sandbox_problem.cache_clear()
    assert sandbox_problem() is None
