"""How work gets in and results get out: the client, the CLI, the batch store."""

from .client import AsyncClient, Batch, Client
from .errors import BatchNotFound, Refused, Stalled, VQueueError, WaitTimeout

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
