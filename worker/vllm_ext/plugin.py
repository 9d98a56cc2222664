"""vqueue's vLLM plugin (``pyproject.toml``: entry point ``vllm.general_plugins: vqueue``).

vLLM runs every general plugin in each of its processes, and any vLLM in the environment would
run this one: a ``vllm serve`` beside the worker too. So it acts only inside engines a vqueue
worker starts: the worker puts its pid (``VQUEUE_ENGINE_OWNER``) and its plan
(``VQUEUE_ENGINE_PLAN``, ``worker.vllm_ext.compat.Plan``) into the environment its engine's
processes inherit, and the plugin installs exactly what that plan says. Without them it does
nothing.

Inside the worker's engine it also keeps the engine's processes from outliving the worker: a
worker killed with SIGKILL cannot shut its engine down, and an orphaned engine keeps its memory
(on a GPU, the card's, so the restarted worker could not allocate its KV cache). A watchdog
thread in each engine process exits it within a second of the worker's death.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable

OWNER_ENV = "VQUEUE_ENGINE_OWNER"
PLAN_ENV = "VQUEUE_ENGINE_PLAN"
PLUGIN = "worker.vllm_ext.plugin:vllm_plugin"  # as the entry point names it
WATCH_S = 0.5  # how often an engine process looks for its worker

# vLLM's logger tree, so these lines show in the engine process's log
log = logging.getLogger("vllm.vqueue")


def vllm_plugin() -> None:
    owner = os.environ.get(OWNER_ENV)
    raw = os.environ.get(PLAN_ENV)
    if not owner or not raw:
        return  # not an engine a vqueue worker started: leave vLLM as it is
    plan = json.loads(raw)
    if int(owner) != os.getpid():
        watch_owner(int(owner))
    from worker.vllm_ext.guided import install_batched_guided_step, install_grammar_reuse

    threads = _grammar_threads()
    if plan.get("guided_batching"):
        install_batched_guided_step(threads, reorder=bool(plan.get("mask_reorder")))
    if plan.get("grammar_reuse"):
        install_grammar_reuse(threads)
    if plan.get("loop_check"):
        from worker.vllm_ext.loops import install

        install()
    if plan.get("monitor") == "v2-hook":
        from worker.vllm_ext.monitor import install_v2_hook

        install_v2_hook()


def _grammar_threads() -> int:
    try:
        from schemas import Settings

        return Settings().grammar_threads
    except Exception:  # noqa: BLE001  # a broken VQUEUE_* variable is the worker's to report
        return 0


_WATCHED: set[int] = set()


def watch_owner(
    pid: int, every_s: float = WATCH_S, on_gone: Callable[[], None] | None = None
) -> None:
    """Exit this process within ``every_s`` of process ``pid`` dying (once per process), or
    call ``on_gone`` then instead: a process that holds jobs must stop taking them before it
    exits (``worker.app.exit_after_handing_back``)."""
    if pid in _WATCHED:
        return
    _WATCHED.add(pid)
    born = _start_time(pid)

    def watch() -> None:
        while _alive(pid, born):
            time.sleep(every_s)
        log.error("vqueue: the worker (pid %d) is gone; this process exits", pid)
        if on_gone is not None:
            on_gone()
        else:
            os._exit(70)  # EX_SOFTWARE: nothing to flush, and no one left to report to

    threading.Thread(target=watch, name="vqueue-owner-watch", daemon=True).start()


def _start_time(pid: int) -> str | None:
    """The process's start time (``/proc``), so a recycled pid is not taken for it."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, born: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if born is not None and _start_time(pid) != born:
        return False  # gone, and its pid taken by another process
    try:  # a zombie waiting for its parent has exited
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return born is None
