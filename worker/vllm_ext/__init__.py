"""Everything that runs inside vLLM's engine, or touches vLLM below its public API, in one place.

- ``compat``: which optimization runs on which vLLM release (the one table), without importing
  vLLM; the worker plans its engine from it and logs what this vLLM cannot take.
- ``configure``: vLLM's config for a worker's engine, with that plan applied.
- ``plugin``: vLLM's entry point into vqueue; acts only in engines a vqueue worker starts, and
  makes their processes exit with the worker.
- ``monitor``: the confidence monitor in the engine step (early stop).
- ``guided``: guided decoding's batched step, grammar reuse, the mask reordered on the device.

The worker's own modules import none of this at import time.
"""
