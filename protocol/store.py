"""The one store of vqueue's Redis protocol, written by workers and read by producers.

``BatchStore`` is one object over one client; each concept it stores has its own module, which
lists its keys (all under the settings' ``key_prefix``), and each Lua script its own file
(``protocol/lua/``, loaded by ``protocol.scripts``):

- ``protocol.batches``       a batch's jobs: claim, start, record, withdraw
- ``protocol.results``       reading a batch: counts, its results stream, taking them out
- ``protocol.feeds``         how far a batch's input was fed, by whom, its canary
- ``protocol.registry``      live workers and the queues they consume
- ``protocol.dead_letters``  jobs that ran out of deliveries
- ``protocol.templates``     registered extraction templates
- ``protocol.limits``        per-tenant token buckets
"""

from __future__ import annotations

import redis

from schemas import Settings

from .batches import MARKS_PER_SHARD, WITHDRAWN, Batches, check_batch_id, mark_shard
from .dead_letters import DeadLetters
from .feeds import Feeds
from .limits import Limits
from .registry import Registry
from .results import Results
from .templates import Templates

__all__ = [
    "MARKS_PER_SHARD",
    "POOL_CONNECTIONS",
    "WITHDRAWN",
    "BatchStore",
    "check_batch_id",
    "mark_shard",
    "refused_for_memory",
]


def refused_for_memory(exc: BaseException) -> bool:
    """Whether Redis refused a write for ``maxmemory``: ``OutOfMemoryError`` for a command, and
    for a script on Redis 7; Redis 6 reports a script's refusal as a ``ResponseError`` that
    quotes the ``OOM`` error inside it."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and "-OOM command not allowed" in str(
        exc
    )


POOL_CONNECTIONS = 64  # per process; threads beyond it queue for a connection


def _retrying_client(url: str, retry_s: float) -> redis.Redis:
    """A client that rides out a Redis restart (AOF reload included) for about ``retry_s``."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import BusyLoadingError, ConnectionError, TimeoutError
    from redis.retry import Retry

    cap = 2.0
    retries = max(1, int(retry_s / cap) + 4)
    # A blocking pool: when every connection is busy a thread waits for one. redis-py 8 caps a
    # plain pool at 100 connections and raises past it, which failed results in a worker
    # running 512 jobs at once.
    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=POOL_CONNECTIONS,
        timeout=max(retry_s, 5.0),
        decode_responses=True,
        health_check_interval=30,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=cap, base=0.05), retries),
        retry_on_error=[BusyLoadingError, ConnectionError, TimeoutError],
    )
    return redis.Redis(connection_pool=pool)


class BatchStore(Templates, Feeds, Limits, Registry, DeadLetters, Results, Batches):
    """Typed access to everything vqueue keeps in Redis; one instance per process is plenty."""

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "vqueue", ttl_s: int = 7 * 24 * 3600, retry_s: float = 120
    ) -> BatchStore:
        return cls(_retrying_client(url, retry_s), prefix, ttl_s)

    @classmethod
    def from_settings(cls, s: Settings) -> BatchStore:
        return cls.from_url(s.backend_url(), s.key_prefix, s.result_ttl_s, s.redis_retry_s)
