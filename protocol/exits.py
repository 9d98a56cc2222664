"""The ``vqueue`` command's exit codes, one table for every subcommand (dramatiq's ``RET_*``):
a script or a supervisor can tell what went wrong without reading the message. README lists them."""

RET_OK = 0
RET_FAILURE = 1  # anything not below
RET_USAGE = 2  # a bad option or setting
RET_INPUT = 3  # the input file is unusable: missing, unreadable, empty, no valid line
RET_CONNECT = 4  # Redis unreachable
RET_NOT_FOUND = 5  # no such batch, template, dead letter or tenant
RET_TIMEOUT = 6  # --timeout passed while waiting
RET_REFUSED = 7  # refused at a rate or queue-depth limit (VQUEUE_ON_LIMIT=refuse)
RET_STALLED = 8  # waiting ended: no live worker, or no new result, for too long
RET_ENGINE = 9  # (vqueue worker) the engine failed to start or died: restart the worker
RET_CONFIG = 10  # (vqueue worker) this configuration cannot run here
RET_STOPPED = 11  # Redis refused part of a submission (full, or gone); the batch id is printed
RET_PAUSED = 12  # the batch's canary failed: the rest waits for `vqueue resume` or `vqueue cancel`
RET_INTERRUPTED = 130  # Ctrl-C while waiting (the shell's 128 + SIGINT); the batch runs on
