"""``vqueue``: submit JSONL files, follow batches, read results, start workers.

Data goes to stdout, progress and errors to stderr. Errors are one line and a named exit code,
one table for the whole binary (``vqueue worker`` exits with the worker's):

    0 OK    1 FAILURE    2 USAGE    3 INPUT (file unusable)    4 CONNECT (Redis unreachable)
    5 NOT_FOUND (no such batch)    6 TIMEOUT (--timeout passed while waiting)
    7 REFUSED (a rate or queue-depth limit, with VQUEUE_ON_LIMIT=refuse)
    8 STALLED (waiting ended: no live worker, or no new result, for too long)
    9 ENGINE (a worker's engine failed to start or died: restart it)
    10 CONFIG (`vqueue worker --check`: this configuration cannot run)
    11 STOPPED (Redis refused part of a submission)
    12 PAUSED (the batch's canary failed: `vqueue resume` or `vqueue cancel` decides)
    130 INTERRUPTED (Ctrl-C while waiting)
"""

from . import admin, read, submit  # noqa: F401  (each registers its commands on the group)
from .base import cli

__all__ = ["cli", "main"]


def main() -> None:
    cli(prog_name="vqueue")
