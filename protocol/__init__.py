"""What producers and workers agree on beyond the job models in ``schemas/``: the wire.

Every Redis key and queue name, the Celery message a job travels in, the Lua scripts that
claim, record, read and withdraw a batch's jobs, the worker registry and the rescue of a dead
worker's queue, dead letters, registered templates, and the exit codes of the ``vqueue``
command. ``producer/`` and ``worker/`` import this package and ``schemas/``, never each other.

- ``wire``: queue names per priority step, task names, the message format, pushing messages.
- ``routing``: per-worker and urgent queues, prefix routing, moving a dead worker's jobs.
- ``store``: batches, results, the worker registry, dead letters, templates (``BatchStore``).
- ``exits``: the exit-code table.
"""
