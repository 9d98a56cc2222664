"""``vqueue serve``: OpenAI's Files and Batches API in front of the queue, for services that do
not speak Python or Celery, and for the official ``openai`` SDK (``base_url`` pointing here).

A batch is a vqueue batch under the same id: the server checks the whole input file first
(an invalid line fails the batch with OpenAI-style ``errors``, nothing runs), then submits it
with the producer's ``Client`` as the caller's tenant, so that tenant's rate and queue-depth
limits apply here, on the server. A background loop (and every read) moves batches along:
counts from the batch store, the deadline of ``completion_window``, and at the end the output
and error files written from the stored results. Cancel and expiry withdraw the jobs not yet
started (the worker checks at each job's start); jobs already running finish and are kept.

Tenants are bearer API keys (``vqueue keys create TENANT``), stored as SHA-256 digests only.
A tenant sees only its own files and batches: anyone else's are 404, never 403. Metadata lives
in Redis under the key prefix, file contents under ``VQUEUE_FILES_DIR``.
"""

from .app import create_app, serve
from .batches import Batches
from .store import ApiStore

__all__ = ["ApiStore", "Batches", "create_app", "serve"]
