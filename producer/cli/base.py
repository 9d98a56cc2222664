"""What every ``vqueue`` command shares: the group and its options, the one error line and
exit code, the progress bars, following a batch's results into files."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import IO, TYPE_CHECKING, Any, NoReturn

import click
import redis
from pydantic import ValidationError
from pydantic_core import to_json

from protocol.exits import (
    RET_CONNECT,
    RET_FAILURE,
    RET_INTERRUPTED,
    RET_STALLED,
    RET_TIMEOUT,
    RET_USAGE,
)
from schemas import (
    BatchStatus,
    CanaryReport,
    JobResult,
    Settings,
    get_settings,
    output_line,
)
from schemas.settings import describe_settings_error

if TYPE_CHECKING:
    pass


# Per-line errors echoed to stderr before the rest are only counted (all go to --errors).
MAX_ECHOED_ERRORS = 20


def fail(message: str, code: int = RET_FAILURE) -> NoReturn:
    click.secho(f"vqueue: {message}", fg="red", err=True)
    sys.exit(code)


class Ctx:
    """Shared options, resolved once; they default to the VQUEUE_* settings."""

    def __init__(self, broker: str | None, queue: str | None, tenant: str | None = None) -> None:
        pairs = (("broker_url", broker), ("queue", queue), ("tenant", tenant))
        updates = {k: v for k, v in pairs if v is not None}
        try:  # validated as the environment's values are: an empty or reserved queue is refused
            base = get_settings()
            self.settings: Settings = Settings.model_validate({**base.model_dump(), **updates})
        except ValidationError as exc:
            options = {"broker_url": "--broker", "queue": "--queue", "tenant": "--tenant"}
            named = {k: v for k, v in options.items() if k in updates}
            fail(f"invalid settings: {describe_settings_error(exc, named)}", RET_USAGE)
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            from ..client import Client

            try:  # fail fast here (one try, no redis-py retries, which would back off for a
                # minute); the client's own connections ride out a later restart
                probe = redis.Redis.from_url(
                    self.settings.backend_url(), socket_connect_timeout=5, socket_timeout=5,
                    retry=Retry(NoBackoff(), 0),
                )  # fmt: skip
                probe.ping()
                probe.close()
                self._client = Client(self.settings, on_wait=_say)
            except redis.RedisError as exc:
                fail(
                    f"cannot reach Redis at {_redact(self.settings.backend_url())}: {exc}",
                    RET_CONNECT,
                )
        return self._client


def _check_batch(batch: str | None) -> None:
    if batch is None:
        return
    from protocol.store import check_batch_id

    try:
        check_batch_id(batch)
    except ValueError as exc:
        fail(str(exc), RET_USAGE)


def _say(message: str) -> None:
    click.echo(f"vqueue: {message}", err=True)


def _redact(url: str) -> str:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    if u.password:
        return url.replace(f":{u.password}@", ":***@")
    return url


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--broker", metavar="URL", help="Redis URL [env VQUEUE_BROKER_URL]")
@click.option("--queue", metavar="NAME", help="Celery queue [env VQUEUE_QUEUE]")
@click.option(
    "--tenant", metavar="NAME", help="Whose jobs: rate limits, templates [env VQUEUE_TENANT]"
)
@click.pass_context
def cli(ctx: click.Context, broker: str | None, queue: str | None, tenant: str | None) -> None:
    """Batch LLM jobs through Redis into GPU workers running vLLM."""
    ctx.obj = Ctx(broker, queue, tenant)


def _bar(quiet: bool, **kw: Any) -> Any:
    from tqdm import tqdm

    # off a terminal (a log, a pipe) no bar: its redraws would interleave with error lines
    return tqdm(
        file=sys.stderr, disable=True if quiet else None, dynamic_ncols=True, mininterval=0.5, **kw
    )


def _write_result(res: JobResult, out: IO[str] | None, errors: IO[str] | None) -> None:
    failed = res.status == "failed"
    target = errors if (failed and errors) else out
    if target is None:
        return
    if res.format == "vqueue":  # pydantic's serializer in one pass, not its dict through json
        target.write(res.model_dump_json() + "\n")
    else:  # pydantic's serializer too: an embeddings line holds thousands of floats, which
        # json.dumps writes far slower (docs/benchmarks.md, "Embeddings")
        target.write(to_json(output_line(res)).decode() + "\n")


def _follow(
    client: Any,
    batch: str,
    out: IO[str] | None,
    errors: IO[str] | None,
    quiet: bool,
    timeout: float | None,
    take: bool = False,
    feeder: threading.Thread | None = None,
    on_lost: Callable[[], None] | None = None,
) -> BatchStatus:
    """Stream results to the files with a done/failed/rate/ETA bar until the batch is done.
    ``take``: results leave Redis once they are written (and flushed to disk) here.
    ``feeder``: the thread still feeding the batch, whose total grows meanwhile."""
    from ..errors import Stalled, WaitTimeout

    handle = client.batch(batch)
    st = handle.status()
    bar = _bar(
        quiet,
        total=st.total,
        unit="job",
        desc="done",
        bar_format="{desc}: {n}/{total} {postfix} |{bar}| {rate_fmt} ETA {remaining}",
    )
    failed = unsaved = 0
    saved_at = time.monotonic()

    def save() -> None:
        """Flush what was written; with ``take``, then let the results leave Redis."""
        nonlocal unsaved, saved_at
        _flush(out, errors)
        if take and handle.last_entry != "0-0":
            client.store.take(batch, handle.last_entry, _written(out, errors))
        unsaved, saved_at = 0, time.monotonic()

    try:
        for res in handle.results(timeout=timeout, on_lost=on_lost):
            _write_result(res, out, errors)
            if res.status == "failed":
                failed += 1
                bar.set_postfix_str(f"failed {failed}", refresh=False)
            if not bar.disable and bar.total is not None and bar.n >= bar.total:
                # the feed has sent more since the total was read: past it, tqdm would show
                # the total as unknown ("None")
                bar.total = max(handle.status().total, bar.n + 1)
            bar.update(1)
            unsaved += 1
            if unsaved >= 1000 or time.monotonic() - saved_at > 1.0:
                if feeder is not None and feeder.is_alive():
                    bar.total = handle.status().total
                save()
        save()
    except WaitTimeout as exc:
        bar.close()
        fail(str(exc), RET_TIMEOUT)
    except Stalled as exc:
        bar.close()
        fail(str(exc), RET_STALLED)
    bar.close()
    st = client.batch(batch).status()
    click.echo(
        f"batch {batch}: {st.completed} completed, {st.failed} failed, {st.rejected} rejected",
        err=True,
    )
    return st


def _flush(*files: IO[str] | None) -> None:
    """Written results on disk (as far as the files are files), before they leave Redis."""
    for fh in files:
        if fh is None:
            continue
        fh.flush()
        with contextlib.suppress(OSError, ValueError):  # a pipe or a terminal: nothing to sync
            os.fsync(fh.fileno())


def _open_for_writing(
    stack: ExitStack, path: str | None, option: str, keep: int | None = None
) -> IO[str] | None:
    """``path`` opened for writing, empty; ``keep``: its first ``keep`` bytes kept (what an
    earlier ``--take`` of the batch wrote there and took out of Redis)."""
    if path is None:
        return None
    try:
        if keep is None:
            return stack.enter_context(open(path, "w"))
        fh = stack.enter_context(open(path, "r+"))
        fh.truncate(keep)  # past it: written, but still in Redis, so it comes again
        fh.seek(keep)
        return fh
    except OSError as exc:
        fail(f"cannot write {option} {path}: {exc.strerror}; nothing was enqueued", RET_USAGE)


def _kept(client: Any, batch: str, take: bool, path: str | None, which: str) -> int | None:
    """How much of ``path`` an earlier ``--take`` of the batch wrote and took out of Redis:
    a taking reader started again on the same file goes on after it, so no result is lost or
    written twice; None when there is nothing to keep."""
    if not (take and path):
        return None
    taken = client.store.taken(batch)
    if taken.get(which) != os.path.abspath(path) or not os.path.exists(path):
        return None
    return int(taken.get(f"{which}_bytes", 0))


def _written(out: IO[str] | None, errors: IO[str] | None) -> dict[str, Any]:
    """Where a taking reader's results went and how far, recorded as it takes them."""
    got: dict[str, Any] = {}
    for which, fh in (("out", out), ("errors", errors)):
        if fh is not None and fh not in (sys.stdout, sys.stderr):
            got[which] = os.path.abspath(fh.name)
            got[f"{which}_bytes"] = os.fstat(fh.fileno()).st_size
    return got


def _interrupted(batch: str) -> NoReturn:
    """Ctrl-C while waiting: the batch runs on, and the wait can be taken up again."""
    click.echo(
        f"\nvqueue: stopped waiting; batch {batch} runs on. Wait again with: "
        f"vqueue results {batch} --wait",
        err=True,
    )
    sys.exit(RET_INTERRUPTED)


def _warn_if_nobody_consumes(client: Any) -> None:
    queue = client.settings.queue
    if not any(w.get("queue") == queue for w in client.store.workers()):
        _say(f"no live worker consumes queue {queue!r}: the jobs wait there until one starts")


def _canary_words(batch: str, report: CanaryReport) -> str:
    return (
        f"its canary failed ({report.summary()}): {'; '.join(report.reasons)}. "
        f"'vqueue resume {batch}' sends the rest of its input; 'vqueue cancel {batch}' ends it "
        "with what ran"
    )
