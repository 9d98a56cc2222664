"""Whether guided decoding can enforce a JSON Schema, asked where no schema can hurt the asker.

llguidance compiles a schema into a grammar in native code that nothing can interrupt, and it
allocates as much as the schema asks for: one hostile line can hold a thread for minutes or
abort the whole process when an allocation fails. So every check runs in a child process of
its own under an address-space limit (``RLIMIT_AS``), and
the child is killed at the time limit. The asker only waits on a pipe.

The children are few and kept (a check is a round trip on a pipe, not a process start). A
tenant holds at most ``per_tenant`` of them at once, so one tenant's slow schemas leave the
others a child to run on; the time limit runs from the moment a child takes the schema, not
while it waits for one.

A definite answer (enforceable, or what llguidance refuses, or out of memory) is remembered by
schema text; a time-out or a wait for a free child is not, since the same schema can pass on
an idle host. The validators in ``schemas/jobs.py`` ask it through the hook it installs as
``producer`` is imported (``install``): every producer path (CLI, client, HTTP API) validates
through those models, while ``schemas/`` itself does no I/O, and a worker, which compiles
every schema itself (``worker/structured.py``), never starts these children.
"""

from __future__ import annotations

import contextvars
import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

# Whose schemas are being checked: set by whoever validates a tenant's input (the HTTP API per
# batch); one tenant's checks never take every child.
tenant: contextvars.ContextVar[str] = contextvars.ContextVar("vqueue_check_tenant", default="")

_CACHE_SIZE = 4096  # distinct schema texts remembered: a batch reuses a few thousands of times


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # per check, from when a child takes the schema
    memory_bytes: int = 1 << 30  # the child's address space, Python's own included
    children: int = 4  # checks that can run at once in this process
    per_tenant: int = 2  # of those, how many one tenant may hold
    wait_s: float = 60.0  # for a free child; past it the schema is refused as busy, uncached

    @classmethod
    def from_settings(cls) -> Limits:
        from schemas.settings import get_settings

        s = get_settings()
        children = s.schema_check_processes
        return cls(
            timeout_s=s.schema_check_timeout_s,
            memory_bytes=s.schema_check_memory_mb << 20,
            children=children,
            per_tenant=max(1, children // 2),
        )


class Unavailable(Exception):
    """No check can run here: the child could not start or import llguidance."""


class _Child:
    """One checking process: a schema's text in on stdin, llguidance's answer out on stdout."""

    START_S = 60.0  # for the child to import llguidance under its limit

    def __init__(self, memory_bytes: int) -> None:
        # ``-P``: the current directory is not on the child's path (a stray llguidance.py is
        # never imported); the environment is kept, PYTHONPATH included, as the asker has it
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", _CHILD, str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a failed allocation prints a Rust backtrace
            env={**os.environ, "RUST_BACKTRACE": "0"},
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.START_S)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b'"ready"':
            self.kill()
            why = json.loads(line) if line.startswith(b'"') else "it did not start in time"
            raise Unavailable(f"json_schema cannot be checked here: {why}")

    def ask(self, text: str, timeout_s: float) -> str:
        """llguidance's error, "" when the schema is enforceable. Raises ``TimeoutError`` (the
        child is killed) or ``MemoryError`` (it died compiling: an allocation past its limit
        aborts it)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(text).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise MemoryError from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            self.kill()
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise MemoryError
        answer: str = json.loads(line)
        return answer

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Checker:
    """The children of this process and who holds them."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._cond = threading.Condition()
        self._idle: list[_Child] = []
        self._running = 0
        self._held: dict[str, int] = {}
        self._answers: OrderedDict[str, str | None] = OrderedDict()

    def problem(self, text: str, who: str = "") -> str | None:
        """Why guided decoding cannot enforce the schema ``text``, or None when it can."""
        with self._cond:
            if text in self._answers:
                self._answers.move_to_end(text)
                return self._answers[text]
        answer, definite = self._check(text, who)
        if definite:
            with self._cond:
                self._answers[text] = answer
                if len(self._answers) > _CACHE_SIZE:
                    self._answers.popitem(last=False)
        return answer

    def _check(self, text: str, who: str) -> tuple[str | None, bool]:
        lim = self.limits
        try:
            child = self._take(who)
        except Unavailable as exc:
            return str(exc), False
        if child is None:
            return (
                f"json_schema could not be checked: every schema check was busy for "
                f"{lim.wait_s:g}s; submit it again"
            ), False
        kept = False
        try:
            error = child.ask(text, lim.timeout_s)
            kept = True
            if not error:
                return None, True
            first = " ".join(error.strip().splitlines())
            return f"json_schema cannot be enforced by guided decoding: {first[:300]}", True
        except TimeoutError:
            return f"json_schema's grammar did not compile within {lim.timeout_s:g}s", False
        except MemoryError:
            mib = lim.memory_bytes >> 20
            return f"json_schema's grammar needs more than {mib} MiB to compile", True
        finally:
            self._give(who, child if kept and child.alive() else None)

    def _take(self, who: str) -> _Child | None:
        lim = self.limits
        deadline = time.monotonic() + lim.wait_s
        with self._cond:
            while self._running >= lim.children or self._held.get(who, 0) >= lim.per_tenant:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            self._running += 1
            self._held[who] = self._held.get(who, 0) + 1
            child = self._idle.pop() if self._idle else None
        try:  # one that died idle (killed from outside) is replaced, never blamed on a schema
            return child if child is not None and child.alive() else _Child(lim.memory_bytes)
        except BaseException:
            self._give(who, None)
            raise

    def _give(self, who: str, child: _Child | None) -> None:
        with self._cond:
            self._running -= 1
            self._held[who] -= 1
            if not self._held[who]:
                del self._held[who]
            if child is not None:
                self._idle.append(child)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


_checker: Checker | None = None
_lock = threading.Lock()


def checker() -> Checker:
    global _checker
    with _lock:
        if _checker is None:
            _checker = Checker(Limits.from_settings())
        return _checker


def problem(text: str) -> str | None:
    """Why guided decoding (llguidance, the workers' backend) cannot enforce the JSON Schema
    ``text``, or None. A host without llguidance refuses every schema rather than pass on one
    it could not check."""
    if importlib.util.find_spec("llguidance") is None:
        return "json_schema cannot be checked here: llguidance is not installed"
    return checker().problem(text, tenant.get())


# The child: limit its own address space, import llguidance (and nothing else, so the limit is
# spent on the schema), say "ready" or why not, then answer one schema per line until EOF.
_CHILD = """
import json, os, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    import llguidance
except BaseException as exc:
    sys.stdout.write(json.dumps(f"llguidance does not import: {exc}"[:300]) + "\\n")
    sys.exit(1)
sys.stdout.write(json.dumps("ready") + "\\n")
sys.stdout.flush()
for line in sys.stdin:
    text = json.loads(line)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False}
        )
        error = str(llguidance.LLMatcher.validate_grammar(grammar, None))
    except MemoryError:
        os._exit(1)
    except Exception as exc:
        error = str(exc) or type(exc).__name__
    sys.stdout.write(json.dumps(error) + "\\n")
    sys.stdout.flush()
"""


def install() -> None:
    """Make this the enforceability check of the job models' validators (``schemas.jobs``)."""
    from schemas import jobs

    jobs.set_enforceability_check(problem)
