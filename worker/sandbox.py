"""Running a codegen answer against its job's tests, in a sandbox.

The sandbox is bubblewrap (``bwrap``), the one Flatpak runs on: the program sees the system's
interpreter and libraries read-only and nothing else of the host (no home directory, no
project, no sockets), a private writable directory, a fresh ``/tmp``, no network (a namespace
of its own with only loopback), and its own process namespace, so that everything it started
dies with it at the time limit. ``prlimit`` adds the resource limits: CPU seconds, address
space, the size of any file it writes (its output included, which goes to files, never to
the worker's memory), open files. A host without ``bwrap`` (or where it cannot make
namespaces, as in an unprivileged container) runs no tests: jobs that carry them fail with
``sandbox_unavailable``, and ``vqueue worker --check`` says so. Nothing runs unsandboxed.

The program is the answer, then the tests, in one module (HumanEval's form: tests that define
``check(candidate)`` are called with ``entry_point``); the answer is also importable as
``solution`` for tests that import it. It runs on the interpreter the worker runs on, with
its standard library only (no site-packages, no environment variables).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Literal

from pydantic import BaseModel

from schemas import Settings

log = logging.getLogger(__name__)

Outcome = Literal["passed", "failed", "timed_out", "killed"]
DETAIL_CHARS = 300  # of the program's last error line, kept in the result
NOBODY = 65534  # the user a root worker's sandboxed programs run as
MAX_PROCESSES = 64  # processes of that user at once (all sandboxes of the host together)


class TestRun(BaseModel):
    """What one run of the tests came to, and the line that says why when it did not pass."""

    __test__ = False  # not a pytest class

    outcome: Outcome
    detail: str | None = None
    seconds: float


class _SandboxCheck:
    """Why tests cannot run on this host, or None when they can: a real run of bwrap. A
    sandbox that works is kept for good; a problem is looked at again after ``recheck_s``, so
    that a worker running while bubblewrap is installed runs tests within that, unrestarted,
    and says so in its log."""

    recheck_s = 30.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: tuple[float, str | None] | None = None

    def __call__(self) -> str | None:
        with self._lock:
            now = time.monotonic()
            seen = self._seen
            if seen is not None and (seen[1] is None or now - seen[0] < self.recheck_s):
                return seen[1]
            problem = _probe()
            if seen is not None and problem is None:
                log.warning("the test sandbox works now: codegen jobs with tests run again")
            self._seen = (now, problem)
            return problem

    def cache_clear(self) -> None:
        with self._lock:
            self._seen = None


sandbox_problem = _SandboxCheck()


def _probe() -> str | None:
    for tool in ("bwrap", "prlimit", "setpriv"):
        if shutil.which(tool) is None:
            return (
                f"{tool} is not installed (Debian/Ubuntu: apt-get install bubblewrap "
                "util-linux; `make setup` installs them where it can)"
            )
    workdir = _workdir()
    try:
        done = subprocess.run(_command(workdir, 5, 256 << 20, 1 << 20) + ["-c", "0"],
                              capture_output=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not run: {exc}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        return f"bwrap cannot make its namespaces here: {why[0][:200]}"
    return None


def _workdir() -> str:
    """A private directory for one run (0700), owned by the user the program runs as."""
    workdir = tempfile.mkdtemp(prefix="vqueue-tests-")
    if os.geteuid() == 0:
        os.chown(workdir, NOBODY, NOBODY)
    return workdir


def _interpreter() -> str:
    """The worker's interpreter binary itself (a virtual environment's ``python`` is a link
    to it): the sandbox holds its installation, not the environment's packages."""
    return os.path.realpath(sys.executable)


def _command(workdir: str, cpu_s: int, memory_bytes: int, output_bytes: int) -> list[str]:
    prefix = sys.base_prefix  # the interpreter's installation: binary and standard library
    binds = []
    for path in ("/usr", "/lib", "/lib64", "/bin", "/etc/alternatives", prefix,
                 sysconfig.get_paths()["stdlib"]):  # fmt: skip
        if os.path.exists(path):
            binds += ["--ro-bind", path, path]
    common = ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
              "--bind", workdir, "/sandbox", "--remount-ro", "/", "--chdir", "/sandbox",
              "--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH",
              "/usr/bin:/bin", "--setenv", "HOME", "/sandbox",
              "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]  # fmt: skip
    # no environment, no site-packages, nothing written: the standard library and the
    # program's own directory (for ``import solution``) on its path
    python = [_interpreter(), "-E", "-s", "-S", "-B"]
    limits = ["prlimit", f"--cpu={cpu_s}", f"--as={memory_bytes}", f"--fsize={output_bytes}",
              "--nofile=64", "--core=0"]  # fmt: skip
    if os.geteuid() != 0:  # a user namespace of its own, without privileges
        return [*limits, "--", "bwrap", *binds, *common, "--unshare-all", "--cap-drop", "ALL",
                "--", *python]  # fmt: skip
    # As root, bwrap mounts with root's rights (the interpreter may live where only root
    # reads), and the program then runs as nobody: the kernel holds nobody to a process count,
    # where root is exempt from RLIMIT_NPROC, and setuid leaves it no capability
    return [
        *limits, f"--nproc={MAX_PROCESSES}", "--", "bwrap", *binds, *common,
        "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
        "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
        "--", "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
        *python,
    ]  # fmt: skip


_slots: threading.Semaphore | None = None
_slots_lock = threading.Lock()


def _slot(settings: Settings) -> threading.Semaphore:
    """At most ``test_concurrency`` programs at once per worker process: tests take CPU from
    the engine's own processes, as tokenizing does."""
    global _slots
    with _slots_lock:
        if _slots is None:
            _slots = threading.Semaphore(settings.test_concurrency or max(1, os.cpu_count() or 1))
        return _slots


def run_tests(code: str, tests: str, entry_point: str | None, settings: Settings) -> TestRun:
    """Run ``code`` then ``tests`` in the sandbox; ``passed`` when the program exits 0 within
    ``test_timeout_s``. Raises ``RuntimeError`` where no sandbox can run (``sandbox_problem``)."""
    problem = sandbox_problem()
    if problem is not None:
        raise RuntimeError(problem)
    program = f"{code}\n\n{tests}\n"
    if entry_point:
        program += f"\ncheck({entry_point})\n"
    workdir = _workdir()
    try:
        for name, text in (("solution.py", code), ("program.py", program)):
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as fh:
                fh.write(text)
        out_path = os.path.join(workdir, ".output")
        limit = settings.test_timeout_s
        argv = _command(workdir, max(1, int(limit)), settings.test_memory_mb << 20,
                        settings.test_output_bytes) + ["program.py"]  # fmt: skip
        with _slot(settings), open(out_path, "wb") as out:
            started = time.monotonic()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True)  # fmt: skip
            try:
                code_ = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill(proc)
                return TestRun(outcome="timed_out", seconds=round(time.monotonic() - started, 3),
                               detail=f"still running after {limit:g} s: killed")  # fmt: skip
            seconds = round(time.monotonic() - started, 3)
        if os.path.getsize(out_path) >= settings.test_output_bytes:
            return TestRun(outcome="killed", seconds=seconds, detail="its output passed "
                           f"the limit of {settings.test_output_bytes} bytes")  # fmt: skip
        with open(out_path, "rb") as fh:
            tail = fh.read().decode(errors="replace")
        if code_ == 0:
            return TestRun(outcome="passed", seconds=seconds)
        last = next((x.strip() for x in reversed(tail.splitlines()) if x.strip()), "")
        if code_ < 0:
            name = signal.Signals(-code_).name
            why = {"SIGXCPU": "its CPU time ran out", "SIGXFSZ": "it wrote past its output limit",
                   "SIGKILL": "killed"}.get(name, name)  # fmt: skip
            return TestRun(outcome="killed", seconds=seconds, detail=f"{name}: {why}")
        detail = (last or f"exit code {code_}") + _failing_line(tail)
        return TestRun(outcome="failed", seconds=seconds, detail=detail[:DETAIL_CHARS])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


_FRAME = re.compile(r'^\s*File "(?:.*/)?program\.py", line (\d+)')


def _failing_line(output: str) -> str:
    """The program's source line a traceback ended on: `` in `assert add(1, 1) == 3` ``; a bare
    ``AssertionError`` says nothing of which assert failed. (Its line number would count the
    answer's lines too, which differ from one answer to the next.)"""
    lines = output.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if _FRAME.match(lines[i]) is not None:
            source = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if not source or source.startswith(("File ", "^")):
                return ""
            return f" in `{source}`"
    return ""


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """The sandbox and everything in it: bwrap leads its own session, and its process namespace
    ends with it (``--die-with-parent``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
