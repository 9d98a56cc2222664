"""Patches to kombu's Redis transport, each written against and checked on the kombu versions in
``KOMBU_VERIFIED`` (elsewhere the worker logs and runs stock kombu): a broker restart stays a
connection error, one redis-py client per channel, and jobs popped but never recorded as
unacknowledged go back to their list (``Limbo``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .backoff import while_full

log = logging.getLogger(__name__)

# kombu versions whose Redis channel ``guard_closed_channels`` was written against and checked on
KOMBU_VERIFIED = ("5.7.",)


def guard_closed_channels() -> None:
    """Make a broker restart a connection error, never an "Unrecoverable error".

    When Redis goes away, Celery closes the connection and its channels; kombu 5.7's closed Redis
    channel forgets its transport (``channel.connection = None``) and its pools. Anything that
    still asks it for a client afterwards (a task acknowledging its job, the consumer tearing
    down for its reconnect) makes it build a new pool from ``self.connection.client`` and raise
    ``AttributeError``. Celery counts AttributeError as unrecoverable, and the worker would exit
    mid-batch (``test_redis_restart_mid_batch`` restarts Redis under one). Here a closed channel
    raises redis' ``ConnectionError`` instead, which kombu lists among its connection errors: Celery
    reconnects, a failed acknowledgement is logged and the job comes back after the visibility
    timeout (its stored result makes that a lookup). Restoring a closed channel's unacked jobs
    is skipped for the same reason; they stay in kombu's unacked set for that scan.

    Also: a job kombu took off its list but could not record as unacknowledged, because Redis
    went away between the two commands, goes to ``limbo`` instead of nowhere (``Limbo``). And
    when Redis is full (``maxmemory``, noeviction), ``BRPOP`` still pops (it frees memory) but
    the unacknowledged record is refused, and so is an acknowledgement: kombu sends both in a
    MULTI, inside which Redis refuses every command when out of memory. Celery takes that
    ``OutOfMemoryError`` for an unrecoverable error and the worker would exit, the popped job
    lost. Both wait for room instead (``while_full``), holding the consumer, which can
    take nothing more anyway (``test_redis_full_loses_no_job_and_stops_no_worker``).

    Installed on the kombu versions in ``KOMBU_VERIFIED`` only; elsewhere the worker logs an
    error and runs without it.
    """
    import kombu
    from kombu.transport import redis as kombu_redis

    if not kombu.__version__.startswith(KOMBU_VERIFIED):
        log.error(
            "kombu %s is not one the broker-restart guard was checked on (%s); a Redis restart "
            "may stop this worker's consumer", kombu.__version__, ", ".join(KOMBU_VERIFIED),
        )  # fmt: skip
        return
    channel = kombu_redis.Channel
    if getattr(channel._connparams, "__vqueue__", False):
        return
    stock_params, stock_restore = channel._connparams, kombu_redis.QoS.restore_unacked
    closed = kombu_redis.redis.exceptions.ConnectionError

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        transport = self.connection
        if transport is None or getattr(transport, "client", None) is None:
            raise closed("the broker channel is closed (its connection was lost)")
        return stock_params(self, asynchronous=asynchronous)

    def restore_unacked(self: Any, client: Any = None) -> Any:
        try:
            return stock_restore(self, client)
        except (closed, AttributeError) as exc:
            log.warning(
                "broker connection closed before its %d unacknowledged job(s) could be "
                "restored (%s); they return after the visibility timeout",
                len(self._delivered),
                exc,
            )
            return None

    _connparams.__vqueue__ = True  # type: ignore[attr-defined]
    channel._connparams = _connparams  # type: ignore[method-assign]
    kombu_redis.QoS.restore_unacked = restore_unacked  # type: ignore[method-assign]
    _wait_out_full_redis(kombu_redis.QoS, closed, kombu_redis.redis.exceptions.TimeoutError)


def _wait_out_full_redis(qos: Any, closed: type[Exception], timed_out: type[Exception]) -> None:
    """kombu's unacknowledged record, acknowledgement and rejection wait for room while Redis
    is full (``while_full``); a job popped whose record Redis never took goes to ``limbo``."""
    stock_append, stock_ack, stock_reject = qos.append, qos.ack, qos.reject

    def append(self: Any, message: Any, delivery_tag: Any) -> Any:
        try:
            return while_full("consume", lambda: stock_append(self, message, delivery_tag))
        except (closed, timed_out):
            limbo.keep(self.channel, message)
            raise

    def ack(self: Any, delivery_tag: Any) -> Any:
        return while_full("ack", lambda: stock_ack(self, delivery_tag))

    def reject(self: Any, delivery_tag: Any, requeue: bool = False) -> Any:
        return while_full("ack", lambda: stock_reject(self, delivery_tag, requeue=requeue))

    qos.append, qos.ack, qos.reject = append, ack, reject


def reuse_broker_clients() -> None:
    """One redis-py client per kombu channel and pool, instead of a new one per command.

    kombu's Redis channel builds a ``redis.Redis`` around its pool for every command it sends
    outside the consumer's own connection: recording each job as unacknowledged, acknowledging
    it, publishing each task event. ``Redis.__init__`` fills a dict of ~200 response callbacks
    each time, a visible share of a busy consumer thread (docs/benchmarks.md). A client is a
    thin, thread-safe wrapper around its pool, so the channel keeps the one it built while its
    pool stays the same; a reconnect makes a new pool, and with it a new client.

    Same kombu versions as ``guard_closed_channels``; elsewhere the worker logs and runs stock.
    """
    import kombu
    from kombu.transport import redis as kombu_redis

    if not kombu.__version__.startswith(KOMBU_VERIFIED):
        log.error(
            "kombu %s is not one broker client reuse was checked on (%s); running without it",
            kombu.__version__, ", ".join(KOMBU_VERIFIED),
        )  # fmt: skip
        return
    channel = kombu_redis.Channel
    if getattr(channel._create_client, "__vqueue__", False):
        return
    stock = channel._create_client

    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        if asynchronous:
            return stock(self, asynchronous)
        pool = self.pool  # a closed channel raises here, as stock does (guard_closed_channels)
        kept = self.__dict__.get("_vqueue_client")
        if kept is None or kept.connection_pool is not pool:
            kept = self._vqueue_client = stock(self)
        return kept

    _create_client.__vqueue__ = True  # type: ignore[attr-defined]
    channel._create_client = _create_client  # type: ignore[method-assign]


class Limbo:
    """Jobs kombu took off their list that Redis never saw recorded as unacknowledged.

    kombu's Redis transport pops a job (``BRPOP``) and then, in a second command, records it in
    the unacknowledged set; when Redis goes away between the two, the second raises, the job
    never reaches Celery, and Redis holds it nowhere: no visibility timeout brings it back
    (``test_twenty_redis_restarts`` meets this). Here the failed record
    keeps the message, and a thread pushes it back to the head of its list once Redis answers.
    Should the record have landed after all (the reply lost, not the command), the job is
    queued twice, which costs a lookup: results are recorded once. Only a worker killed between
    the two commands still loses its job that way (docs/reliability.md).
    """

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._held: list[tuple[str, str, str]] = []  # (broker url, list key, message)
        self._thread: threading.Thread | None = None

    def keep(self, channel: Any, message: Any) -> None:
        from kombu.utils.json import dumps

        try:
            url = channel.connection.client.as_uri(include_password=True)
            queue = message.delivery_info["routing_key"]
            pri = channel._get_message_priority(message._raw, reverse=False)
            held = (url, channel._q_for_pri(queue, pri), dumps(message._raw))
        except Exception:  # noqa: BLE001  # nothing to keep it by: say so, loudly
            log.exception("a job taken off its list as Redis went away could not be kept")
            return
        log.warning(
            "a job was taken off %s as Redis went away, before it was recorded as "
            "unacknowledged; it goes back to that list once Redis answers",
            held[1],
        )
        with self._lock:
            self._held.append(held)
            if self._thread is None:
                self._thread = threading.Thread(target=self._return, name="vqueue-limbo")
                self._thread.daemon = True
                self._thread.start()

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _return(self) -> None:
        import redis

        while True:
            time.sleep(self.every_s)
            with self._lock:
                items = list(self._held)
            for item in items:
                url, key, payload = item
                try:
                    redis.Redis.from_url(url, socket_timeout=5).rpush(key, payload)
                except redis.RedisError:
                    continue  # still away: next round
                log.warning("a job taken as Redis went away is back on %s", key)
                with self._lock:
                    self._held.remove(item)
            with self._lock:
                if not self._held:
                    self._thread = None
                    return


limbo = Limbo()
