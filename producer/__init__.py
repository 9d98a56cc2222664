"""How work gets in and results get out: the client, the CLI, the batch store."""

from . import grammar_check
from .client import AsyncClient, Batch, Client
from .errors import BatchNotFound, Refused, Stalled, VQueueError, WaitTimeout

# every job a producer validates has its JSON Schema checked for enforceability (schemas.jobs)
grammar_check.install()

__all__ = [
    "AsyncClient",
    "Batch",
    "BatchNotFound",
    "Client",
    "Refused",
    "Stalled",
    "VQueueError",
    "WaitTimeout",
]
