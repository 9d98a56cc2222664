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

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, NoReturn

import click
import redis
from pydantic import ValidationError

from protocol.exits import (
    RET_CONNECT,
    RET_FAILURE,
    RET_INPUT,
    RET_INTERRUPTED,
    RET_NOT_FOUND,
    RET_PAUSED,
    RET_REFUSED,
    RET_STALLED,
    RET_STOPPED,
    RET_TIMEOUT,
    RET_USAGE,
)
from schemas import (
    BatchStatus,
    CanaryReport,
    Envelope,
    JobResult,
    Settings,
    get_settings,
    job_json_schema,
    output_line,
    rejected_line,
)
from schemas.settings import describe_settings_error

if TYPE_CHECKING:
    from .feed import Feed

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

            from .client import Client

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


# ----------------------------------------------------------------------------------- submit
@cli.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--wait", is_flag=True, help="Wait for every result before exiting.")
@click.option(
    "--out", "out_path", type=click.Path(dir_okay=False), help="Write results here (JSONL)."
)
@click.option(
    "--errors",
    "errors_path",
    type=click.Path(dir_okay=False),
    help="Write rejected lines and failed jobs here (JSONL).",
)
@click.option("--batch", "batch_id", help="Batch id (default: generated).")
@click.option(
    "--force",
    is_flag=True,
    help="With --batch: run ids that already have results again (their results are replaced).",
)
@click.option("--priority", type=click.IntRange(0, 9), help="Priority for lines that set none.")
@click.option(
    "--no-cache",
    is_flag=True,
    help="Run every line in the engine: no answer from the result cache, none stored in it.",
)
@click.option(
    "--system",
    metavar="TEXT",
    help="System prompt for lines that set none ('' for no system turn).",
)
@click.option(
    "--canary",
    metavar="SHARE",
    help="Run this share of the lines first (e.g. 2%), spread over FILE, and send the rest only "
    "if their answers pass the VQUEUE_CANARY_* checks; else the batch pauses (exit 12).",
)
@click.option("--timeout", type=float, help="With --wait: give up after this many seconds.")
@click.option(
    "--take",
    is_flag=True,
    help="With --wait --out: results leave Redis once written (else they stay for the TTL).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON summary instead of the batch id."
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@click.pass_obj
def submit(
    obj: Ctx,
    file: str,
    wait: bool,
    out_path: str | None,
    errors_path: str | None,
    batch_id: str | None,
    force: bool,
    priority: int | None,
    no_cache: bool,
    system: str | None,
    canary: str | None,
    timeout: float | None,
    take: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Validate FILE (JSONL, '-' for stdin) line by line and enqueue the good lines.

    Bad lines are reported with their line numbers and never stop the rest. The exit code is
    non-zero only when the file itself is unusable (missing, empty, no valid line). An input
    bigger than the batch's window (VQUEUE_FEED_WINDOW) is fed as workers finish jobs; if
    this process dies, the same command with --batch ID resumes the feed where it stopped.
    """
    from .client import new_batch_id
    from .feed import Feed, run_in_thread
    from .inputs import Parsed, expected_lines, rejected_result

    share = None
    if canary is not None:
        from .canary import parse_share

        try:
            share = parse_share(canary)
        except ValueError as exc:
            fail(f"--canary: {exc}", RET_USAGE)
        if file == "-":
            fail("--canary needs a file: its lines are read once for the canary", RET_USAGE)
    if (out_path or errors_path) and not wait:
        fail("--out and --errors need --wait (or use 'vqueue results BATCH' later)", RET_USAGE)
    if take and not out_path:
        fail("--take needs --wait and --out: results leave Redis once written there", RET_USAGE)
    _check_batch(batch_id)
    try:
        fh: BinaryIO = sys.stdin.buffer if file == "-" else open(file, "rb")  # noqa: SIM115
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror}", RET_INPUT)
    client = obj.client
    batch = batch_id or new_batch_id()
    size = os.fstat(fh.fileno()).st_size if file != "-" else None
    source = None if file == "-" else os.path.abspath(file)
    skip = 0 if force or source is None else _resume_at(client, batch, source)
    with ExitStack() as stack:
        stack.enter_context(fh)
        # opened before anything is enqueued: a path that cannot be written fails here, alone
        out_file = _open_for_writing(
            stack, out_path, "--out", _kept(client, batch, take, out_path, "out")
        )
        errors_out = _open_for_writing(
            stack, errors_path, "--errors", _kept(client, batch, take, errors_path, "errors")
        )
        bar = _bar(quiet, total=size, unit="B", unit_scale=True, desc="submit")
        created = client.store.create(
            batch, "vqueue", source=source, queue=client.settings.queue,
            expected=expected_lines(source) if source and os.path.isfile(source) else None,
        )  # fmt: skip
        # The jobs of the batch's own input file are known by their line, one bit each once
        # done (``protocol.store``); those of another input, or of stdin (which cannot be read
        # again to say which line was which), by their id.
        by_line = source is not None and (created or client.store.feed_state(batch)[2] == source)

        def reject(p: Parsed, error: str) -> None:
            """A bad line: echoed (the first few), and in the errors file in the line's own
            format, as its batch's failed results are."""
            if feed.rejected <= MAX_ECHOED_ERRORS:
                bar.write(f"line {p.line}: {error}", file=sys.stderr)
            if errors_out:
                ident = p.custom_id or (p.job.id if p.job is not None else None)
                if p.format == "vqueue":
                    errors_out.write(rejected_result(batch, p, ident, error).model_dump_json())
                else:
                    errors_out.write(json.dumps(rejected_line(ident, p.line, error)))
                errors_out.write("\n")

        feed = Feed(
            client, batch, fh, source, priority=priority, system=system, cache=not no_cache,
            by_line=by_line, skip=skip, on_reject=reject, on_bytes=bar.update,
        )  # fmt: skip
        ran_canary = 0  # the canary's jobs, sent before the feed (which skips them)
        if share is not None and created:
            sample = feed.canary(share)
            if not sample:
                bar.close()
                client.store.delete(batch)
                fail(f"{file}: no valid job among the canary's lines", RET_INPUT)
            ran_canary, report = _canary(client, batch, sample, quiet, timeout)
            options = {"priority": priority, "system": system, "no_cache": no_cache}
            client.store.canary_ended(batch, report, options)
            if not report.passed:
                bar.close()
                if as_json:
                    click.echo(json.dumps({"batch": batch, "paused": True,
                                           "canary": report.model_dump()}))  # fmt: skip
                else:
                    click.echo(batch)  # as on success: a script reads the batch id from stdout
                fail(f"batch {batch} paused: {_canary_words(batch, report)}", RET_PAUSED)
            _say(f"batch {batch}: its canary passed ({report.summary()}); sending the rest")
        elif share is not None:
            _say(f"batch {batch} exists: no canary runs for the rest of its input")

        from .client import Refused, SubmissionStopped

        st: BatchStatus | None = None

        def feed_failed() -> None:
            exc = outcome.get("error")
            if exc is None:
                return
            bar.close()
            if isinstance(exc, Refused):
                fail(f"{exc}; the jobs before it are enqueued in batch {batch}", RET_REFUSED)
            if isinstance(exc, SubmissionStopped):
                click.echo(batch)  # as on success: a script reads the batch id from stdout
                fail(str(exc), RET_STOPPED)
            raise exc

        def resend() -> None:
            sent = feed.resend()
            _say(f"batch {batch}: {sent} job(s) were lost on the way (a worker "
                 "killed as it took them); sent again")  # fmt: skip

        # the input is read once the feed ends: its bar ends then, not after the wait
        feeder, started, outcome = run_in_thread(feed, force, on_end=bar.close)
        try:
            if wait:  # results are read while the rest of the input is fed
                while not started.wait(0.5):
                    pass
                if feeder.is_alive() or (outcome.get("handle") and feed.good > 0):
                    if not as_json:
                        click.echo(batch)
                        sys.stdout.flush()

                    st = _follow(
                        client, batch, out_file, errors_out, quiet, timeout, take, feeder,
                        resend if source else None,
                    )  # fmt: skip
            while feeder.is_alive():
                feeder.join(0.5)
        except KeyboardInterrupt:
            feeder.join(2.0)  # a feed about to end ends: only the wait was interrupted
            if feeder.is_alive():
                _say(f"the feed of batch {batch} stopped after {feed.good - skip} more jobs; "
                     f"send the rest with: vqueue submit {file} --batch {batch}")  # fmt: skip
                sys.exit(RET_INTERRUPTED)
            _interrupted(batch)
        feed_failed()
        bar.close()
        _submitted(client, feed, outcome["handle"], file, errors_path, created, ran_canary,
                   wait, as_json, st)  # fmt: skip


def _submitted(
    client: Any, feed: Feed, handle: Any, file: str, errors_path: str | None, created: bool,
    ran_canary: int, wait: bool, as_json: bool, st: BatchStatus | None,
) -> None:  # fmt: skip
    """What ``vqueue submit`` says once its input is fed: the lines rejected beyond those
    echoed, the jobs skipped or not sent again, the counts; the batch id (or the JSON summary)
    on stdout. An input without a good line enqueued nothing: its batch goes, and it fails."""
    batch, rejected = feed.batch, feed.rejected
    if rejected > MAX_ECHOED_ERRORS:
        click.echo(
            f"... and {rejected - MAX_ECHOED_ERRORS} more rejected lines"
            + (f" (all in {errors_path})" if errors_path else ""),
            err=True,
        )
    if feed.good == 0:
        if created:
            client.store.delete(batch)
        fail(
            f"{file}: no valid job in {rejected} non-blank lines; nothing was enqueued"
            if rejected
            else f"{file}: no jobs (empty input)",
            RET_INPUT,
        )
    try:  # the batch is whole in Redis from here: Ctrl-C leaves it running, and says so
        if handle.skipped > ran_canary:
            skipped = handle.skipped - ran_canary
            _say(f"{skipped} job(s) skipped: their ids already have results in batch {batch}")
        if handle.queued_before:
            _say(f"{handle.queued_before} job(s) not sent again: they are queued or running "
                 f"in batch {batch} already")  # fmt: skip
            if feed.source and client.lost(batch):  # unless the batch went quiet without them
                sent = feed.resend()
                _say(f"batch {batch}: {sent} job(s) were lost on the way (a worker "
                     "killed as it took them); sent again")  # fmt: skip
        good = feed.good - handle.skipped
        canary_note = f" (and {ran_canary} in its canary)" if ran_canary else ""
        click.echo(
            f"batch {batch}: {good} jobs enqueued{canary_note}, {rejected} lines rejected",
            err=True,
        )
        if not wait:
            if not as_json:
                click.echo(batch)
                sys.stdout.flush()
            _warn_if_nobody_consumes(client)
        if as_json:
            summary: dict[str, Any] = {"batch": batch, "enqueued": good, "rejected": rejected}
            if st:
                summary.update(completed=st.completed, failed=st.failed)
            click.echo(json.dumps(summary))
    except KeyboardInterrupt:
        _interrupted(batch)


def _canary(
    client: Any, batch: str, jobs: list[Envelope], quiet: bool, timeout: float | None
) -> tuple[int, CanaryReport]:
    """Run the canary (``producer.canary.run``) with a bar; exits as waiting does when it
    cannot end."""
    from .canary import run
    from .client import BatchNotFound, WaitTimeout

    _say(f"batch {batch}: canary of {len(jobs)} jobs; the rest waits for their answers")
    bar = _bar(quiet, total=len(jobs), unit="job", desc="canary")
    deadline = None if timeout is None else time.monotonic() + timeout
    told = False

    def tick(st: BatchStatus) -> None:
        nonlocal told
        bar.update(st.done - bar.n)
        if deadline is not None and time.monotonic() > deadline and st.done < st.total:
            raise WaitTimeout(f"batch {batch}: its canary has {st.remaining} jobs running")
        if not told and not client.store.consumed(client.settings.queue):
            told = True
            _warn_if_nobody_consumes(client)

    try:
        return run(client, batch, jobs, tick)
    except WaitTimeout as exc:
        fail(f"{exc}; the rest of the input was not sent", RET_TIMEOUT)
    except BatchNotFound as exc:
        fail(str(exc), RET_NOT_FOUND)
    except KeyboardInterrupt:
        _say(f"batch {batch}: the canary runs on; nothing else of the input was sent")
        sys.exit(RET_INTERRUPTED)
    finally:
        bar.close()


def _canary_words(batch: str, report: CanaryReport) -> str:
    return (
        f"its canary failed ({report.summary()}): {'; '.join(report.reasons)}. "
        f"'vqueue resume {batch}' sends the rest of its input; 'vqueue cancel {batch}' ends it "
        "with what ran"
    )


def _resume_at(client: Any, batch: str, source: str) -> int:
    """Where a feed of ``source`` into ``batch`` that did not finish stopped (its process
    killed, Redis full, Ctrl-C): the jobs before it are sent and are not sent again. Refuses
    while that feed still runs."""
    from .client import feed_stopped

    fed, fed_at, was, by = client.store.feed_state(batch)
    if fed is None or was != source:
        return 0
    if not feed_stopped(fed_at, by):
        quiet_s = time.time() - (fed_at or 0)
        fail(
            f"batch {batch} is being fed from {source} by another process (it showed it was "
            f"alive {quiet_s:.0f}s ago); wait for it, or stop it and submit again",
            RET_USAGE,
        )
    _say(f"batch {batch}: resuming its feed after the {fed} jobs already sent")
    return fed


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
    else:
        target.write(json.dumps(output_line(res), ensure_ascii=False) + "\n")


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
    from .client import Stalled, WaitTimeout

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


# ----------------------------------------------------------------------------------- status
@cli.command()
@click.argument("batch", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", is_flag=True, help="Redraw every second until interrupted (or done).")
@click.pass_obj
def status(obj: Ctx, batch: str | None, as_json: bool, watch: bool) -> None:
    """A batch's progress, or (without BATCH) the live workers and the queue depth."""
    _check_batch(batch)
    client = obj.client
    while True:
        text = _batch_status(client, batch, as_json) if batch else _fleet_status(client, as_json)
        if not watch:
            click.echo(text)
            return
        click.echo("\x1b[H\x1b[2J" + text, nl=True)  # clear and redraw in place
        if batch and client.store.is_sealed(batch) and client.batch(batch).status().remaining == 0:
            return
        time.sleep(1)


def _batch_status(client: Any, batch: str, as_json: bool) -> str:
    from .client import BatchNotFound

    try:
        st = client.batch(batch).status()
    except BatchNotFound as exc:
        fail(str(exc), RET_NOT_FOUND)
    elapsed = max((st.updated_at or time.time()) - st.created_at, 1e-9)
    rate = st.done / elapsed
    eta = st.remaining / rate if rate > 0 else None
    hits = st.prefix_hit_rate
    if as_json:
        d = st.model_dump()
        d.update(done=st.done, remaining=st.remaining, rate_per_s=rate, eta_s=eta)
        d.update(prefix_hit_rate=hits)
        return json.dumps(d)
    eta_txt = f"{eta:.0f}s" if eta is not None else "-"
    return (
        f"batch {batch}: {st.done}/{st.total} done ({st.completed} completed, {st.failed} failed),"
        f" {st.remaining} remaining, {st.rejected} rejected at submit;"
        f" {rate:.2f} jobs/s, ETA {eta_txt}"
        + (f"; prefix cache {hits:.0%} of prompt tokens" if hits is not None else "")
        + (f"\nsubmission stopped: {st.error}" if st.error else "")
        + _feed_line(batch, st)
        + _canary_line(batch, st)
    )


def _canary_line(batch: str, st: BatchStatus) -> str:
    if st.canary is None:
        return ""
    if st.paused:
        return f"\npaused: {_canary_words(batch, st.canary)}"
    if st.canary.passed:
        return f"\ncanary passed: {st.canary.summary()}"
    return f"\ncanary failed, then resumed: {'; '.join(st.canary.reasons)}"


def _feed_line(batch: str, st: BatchStatus) -> str:
    """How a feed not finished stands: alive, or stopped and waiting to be resumed."""
    from .client import feed_stopped

    if st.fed is None:
        return ""
    if not st.sealed and not feed_stopped(st.fed_at, st.fed_by):
        return f"\nfeeding: {st.fed} jobs of its input sent so far"
    return (
        f"\nits feed stopped after {st.fed} jobs of its input; submit the same input again "
        f"with --batch {batch} to send the rest"
    )


def _fleet_status(client: Any, as_json: bool) -> str:
    """Every live worker (from its heartbeat) and the depth of every queue one consumes."""
    from protocol.routing import urgent_queue, worker_queue

    workers = client.store.workers(lanes=True)
    shared = {client.settings.queue, *(w["queue"] for w in workers if w.get("queue"))}
    shared |= {urgent_queue(q) for q in shared}
    own = {worker_queue(w["queue"], w["name"]) for w in workers if w.get("routed")}
    names = sorted(shared | own)
    depths = {q: client.queue_depth(q) for q in names}
    if as_json:
        return json.dumps({"queues": depths, "workers": workers})
    lines = [f"queue {q}: {d} waiting" for q, d in depths.items()]
    lanes = [w for w in workers if w.get("urgent_of")]
    urgent = sum((w.get("lane") or "urgent") == "urgent" for w in lanes)
    lines.append(
        f"{len(workers) - len(lanes)} live worker(s)"
        + (f", {urgent} with an urgent process" if urgent else "")
        + (f", {len(lanes) - urgent} more bulk process(es)" if len(lanes) > urgent else "")
    )
    for w in workers:
        if w.get("urgent_of"):  # another client of that worker's engine core
            lines.append(
                f"  {w['name']}  {w.get('lane') or 'urgent'} process of {w['urgent_of']}"
                f" in_flight={w['in_flight']}/{w['concurrency']} done={w['jobs_done']}"
            )
            continue
        up = time.time() - (w.get("started_at") or time.time())
        kv = w.get("kv_cache_usage")
        lines.append(
            f"  {w['name']}  host={w['host']} gpus={w.get('gpus') or '-'}"
            f" model={','.join(w.get('models') or [w['model']])}"
            f" queue={w.get('queue')} in_flight={w['in_flight']}/{w['concurrency']}"
            f" done={w['jobs_done']} tok/s={w.get('tokens_per_s', 0):.0f}"
            f" running={w.get('engine_running', '-')} waiting={w.get('engine_waiting', '-')}"
            f" kv={f'{kv:.0%}' if kv is not None else '-'} up={up:.0f}s"
        )
        engine = w.get("engine")
        if engine:
            lines.append(f"    engine: {describe_plan(engine)}")
    return "\n".join(lines)


def describe_plan(plan: dict[str, Any]) -> str:
    """One line of a worker's engine plan (``worker.vllm_ext.compat.Plan``), degraded first."""
    on = [k for k in ("guided_batching", "grammar_reuse", "mask_reorder") if plan.get(k)]
    on += ["urgent_preempt"] if plan.get("urgent_order") is not None else []
    on += ["loop_check"] if plan.get("loop_check") else []
    text = (
        f"vLLM {plan.get('vllm')}, model runner {plan.get('model_runner')}, early stop "
        f"{plan.get('monitor')}, {', '.join(on) or 'no vqueue patches'}"
    )
    missing = plan.get("missing") or {}
    if missing:
        text = f"DEGRADED ({', '.join(missing)} not installed: see its log) " + text
    return text


# ---------------------------------------------------------------------------------- results
@cli.command()
@click.argument("batch")
@click.option(
    "--out", "out_path", type=click.Path(dir_okay=False), help="Write here instead of stdout."
)
@click.option(
    "--errors",
    "errors_path",
    type=click.Path(dir_okay=False),
    help="Write failed jobs here instead of with the rest.",
)
@click.option("--wait", is_flag=True, help="Follow the batch until its last result.")
@click.option("--timeout", type=float, help="With --wait: give up after this many seconds.")
@click.option("--table", is_flag=True, help="A readable table instead of JSONL.")
@click.option(
    "--take",
    is_flag=True,
    help="Results leave Redis once written (else they stay for VQUEUE_RESULT_TTL_S).",
)
@click.pass_obj
def results(
    obj: Ctx,
    batch: str,
    out_path: str | None,
    errors_path: str | None,
    wait: bool,
    timeout: float | None,
    table: bool,
    take: bool,
) -> None:
    """Write a batch's results as JSONL (OpenAI batch output lines for OpenAI-format jobs).

    With --take each result leaves Redis once it is written and flushed: a second read finds
    only what came since. The batch's counts stay, and its jobs never run again."""
    from .client import BatchNotFound, Stalled, WaitTimeout

    _check_batch(batch)
    if take and table:
        fail("--take writes JSONL: it cannot go with --table", RET_USAGE)
    client = obj.client
    handle = client.batch(batch)
    try:
        handle.status()
    except BatchNotFound as exc:
        fail(str(exc), RET_NOT_FOUND)

    def pairs() -> Iterator[tuple[str, JobResult]]:
        if wait:
            for res in handle.results(timeout=timeout):
                yield handle.last_entry, res
            return
        after = "0-0"
        while page := client.store.read(batch, after):
            for after, res in page:
                yield after, res

    with ExitStack() as stack:
        kept = _kept(client, batch, take, out_path, "out")
        out = _open_for_writing(stack, out_path, "--out", kept) or sys.stdout
        kept = _kept(client, batch, take, errors_path, "errors")
        errors = _open_for_writing(stack, errors_path, "--errors", kept)
        try:
            if table:
                rows = sorted((r for _, r in pairs()), key=lambda r: r.id)
                out.write(render_table(rows) + "\n")
                return
            last, unsaved = "", 0
            for last, res in pairs():
                _write_result(res, out, errors)
                unsaved += 1
                if take and unsaved >= 1000:
                    _flush(out, errors)
                    client.store.take(batch, last, _written(out, errors))
                    unsaved = 0
            if take and last:
                _flush(out, errors)
                client.store.take(batch, last, _written(out, errors))
        except KeyboardInterrupt:
            _interrupted(batch)
        except WaitTimeout as exc:
            fail(str(exc), RET_TIMEOUT)
        except Stalled as exc:
            fail(str(exc), RET_STALLED)


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


def _cells(text: str) -> int:
    """Terminal columns ``text`` takes: East Asian wide and full-width characters take two."""
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _fit(text: str, cols: int, pad: bool = True) -> str:
    """``text`` cut to ``cols`` terminal columns (an ellipsis where cut), padded to them."""
    if _cells(text) > cols:
        out = ""
        for c in text:
            if _cells(out + c) > cols - 1:
                break
            out += c
        text = out + "…"
    return text + " " * (cols - _cells(text)) if pad else text


def render_table(rows: list[JobResult], width: int = 60) -> str:
    """One line per job: what it was, how it ended (``completed*``: answered from the result
    cache, ``cached_from`` names the run), how long it took, what it said; columns counted in
    terminal cells, so Chinese or Japanese text keeps them aligned."""
    head = f"{'id':<12} {'type':<10} {'status':<10} {'tokens':>6} {'secs':>6}  output"
    lines = [head, "-" * (len(head) + width - 6)]
    for r in rows:
        t = r.timings
        secs = (t.finished_at - t.enqueued_at) if t.finished_at else 0.0
        if r.error:
            shown = f"{r.error.type}: {r.error.message}"
        elif r.data is not None:
            shown = json.dumps(r.data, ensure_ascii=False)
        else:
            shown = r.code if r.code is not None else (r.text or "")
        shown = _fit(" ".join(shown.split()), width, pad=False)
        status = f"{r.status}*" if r.cached else r.status
        lines.append(
            f"{_fit(r.id, 12)} {r.type:<10} {status:<10} "
            f"{r.usage.completion_tokens:>6} {secs:>6.1f}  {shown}"
        )
    if any(r.cached for r in rows):
        lines.append("* answered from the result cache (its result's cached_from names the run)")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- dlq
@cli.group()
def dlq() -> None:
    """Dead letters: jobs whose worker was lost every time they ran (VQUEUE_MAX_DELIVERIES)."""


@dlq.command("list")
@click.option("--batch", help="Only this batch's dead letters.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_obj
def dlq_list(obj: Ctx, batch: str | None, as_json: bool) -> None:
    """Dead letters, oldest first: task id (BATCH:JOB), type, deliveries, when, last error."""
    entries = obj.client.store.dead_letters(batch)
    for e in entries:
        if as_json:
            click.echo(json.dumps({k: v for k, v in e.items() if k != "envelope"}))
        else:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["dead_at"]))
            err = (e.get("error") or {}).get("type", "-")
            click.echo(f"{e['task_id']}  {e['type']}  attempts={e['attempts']}  {when}  {err}")
    if not as_json:
        click.echo(f"{len(entries)} dead letter(s)", err=True)


@dlq.command("show")
@click.argument("task_id")
@click.pass_obj
def dlq_show(obj: Ctx, task_id: str) -> None:
    """One dead letter in full, the job's envelope included (JSON)."""
    entry = obj.client.store.dead_letter_entry(task_id)
    if entry is None:
        hint = "ids are BATCH:JOB; see 'vqueue dlq list'"
        fail(f"no dead letter {task_id!r} ({hint})", RET_NOT_FOUND)
    click.echo(json.dumps(entry, indent=2, ensure_ascii=False))


@dlq.command("requeue")
@click.argument("task_ids", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Every dead letter (of --batch).")
@click.option("--batch", help="With --all: only this batch's.")
@click.pass_obj
def dlq_requeue(obj: Ctx, task_ids: tuple[str, ...], everything: bool, batch: str | None) -> None:
    """Send dead letters back to the queue; their failed results are withdrawn."""
    client = obj.client
    if everything == bool(task_ids):
        fail("give TASK_IDS or --all (not both)", RET_USAGE)
    ids = [e["task_id"] for e in client.store.dead_letters(batch)] if everything else task_ids
    missing = [t for t in ids if not client.requeue_dead_letter(t)]
    click.echo(f"{len(ids) - len(missing)} job(s) requeued", err=True)
    if missing:
        fail(f"no dead letter {', '.join(map(repr, missing))}", RET_NOT_FOUND)


# -------------------------------------------------------------------------------- templates
@cli.group()
def templates() -> None:
    """Extraction templates: an instruction, a schema and worked examples an extract job names
    with "template" (schemas/templates.py has the built-in ones)."""


@templates.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_obj
def templates_list(obj: Ctx, as_json: bool) -> None:
    """The templates this tenant's jobs can name: built-in, shared, and the tenant's own (name,
    where from, examples, description)."""
    from schemas.templates import BUILTIN

    rows = [(t, "built-in") for t in BUILTIN.values()]
    rows += obj.client.store.templates(obj.settings.tenant)
    for t, origin in rows:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "name": t.name,
                        "origin": origin,
                        "examples": len(t.examples),
                        "description": t.description,
                    }
                )
            )
        else:
            click.echo(f"{t.name:<20} {origin:<10} {len(t.examples)} examples  {t.description}")
    # fmt: skip


@templates.command("show")
@click.argument("name")
@click.pass_obj
def templates_show(obj: Ctx, name: str) -> None:
    """One template in full (JSON), as `add` takes it."""
    from schemas.templates import BUILTIN

    t = BUILTIN.get(name) or obj.client.store.template(name, obj.settings.tenant)
    if t is None:
        fail(f"no template {name!r} (see 'vqueue templates list')", RET_NOT_FOUND)
    click.echo(t.model_dump_json(indent=2))


@templates.command("add")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--shared", is_flag=True, help="For every tenant, not only --tenant's.")
@click.pass_obj
def templates_add(obj: Ctx, file: str, shared: bool) -> None:
    """Register the template(s) in FILE (a JSON object, or a list of them) for the jobs of
    --tenant (VQUEUE_TENANT), or with --shared of every tenant: a template's examples go into
    every prompt that names it, and may be one tenant's data. A registered name replaces an
    earlier one; built-in names cannot be taken."""
    from schemas.templates import BUILTIN, Template

    try:
        raw = json.loads(sys.stdin.read() if file == "-" else Path(file).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        fail(f"cannot read {file}: {exc}", RET_INPUT)
    items = raw if isinstance(raw, list) else [raw]
    parsed = []
    for i, item in enumerate(items):
        try:
            # the examples are checked against the schema by add_template, under a time limit
            t = Template.model_validate(item, context={"stored": True})
        except ValidationError as exc:
            from .inputs import describe

            fail(f"{file}: template {i + 1}: {describe(exc)}", RET_INPUT)
        if t.name in BUILTIN:
            fail(f"{file}: {t.name!r} is a built-in template; choose another name", RET_INPUT)
        parsed.append(t)
    for t in parsed:
        try:
            obj.client.store.add_template(t, None if shared else obj.settings.tenant)
        except ValueError as exc:
            fail(f"{file}: template {t.name!r}: {exc}", RET_INPUT)
    whose = "every tenant" if shared else f"tenant {obj.settings.tenant!r}"
    names = ", ".join(t.name for t in parsed)
    click.echo(f"{len(parsed)} template(s) registered for {whose}: {names}", err=True)


@templates.command("remove")
@click.argument("name")
@click.option("--shared", is_flag=True, help="The shared one, not --tenant's own.")
@click.pass_obj
def templates_remove(obj: Ctx, name: str, shared: bool) -> None:
    """Unregister a template; jobs that name it then fail with unknown_template."""
    if not obj.client.store.remove_template(name, None if shared else obj.settings.tenant):
        fail(f"no registered template {name!r}", RET_NOT_FOUND)


# ------------------------------------------------------------------------------------- ping
@cli.command()
@click.option(
    "--timeout",
    type=float,
    default=0.0,
    show_default=True,
    help="Wait up to this long for a worker (0: answer at once).",
)
@click.option("--min-workers", type=int, default=1, show_default=True)
@click.pass_obj
def ping(obj: Ctx, timeout: float, min_workers: int) -> None:
    """Exit 0 when at least MIN_WORKERS live workers consume the queue (a health probe)."""
    client = obj.client
    deadline = time.monotonic() + timeout
    while True:
        live = [w for w in client.store.workers() if w.get("queue") == client.settings.queue]
        if len(live) >= min_workers:
            click.echo(f"{len(live)} live worker(s) on queue {client.settings.queue}")
            return
        if time.monotonic() >= deadline:
            fail(
                f"{len(live)} live worker(s) on queue {client.settings.queue}, "
                f"wanted {min_workers}",
                RET_TIMEOUT,
            )
        time.sleep(0.5)


# ----------------------------------------------------------------------------------- cancel
@cli.command()
@click.argument("batch")
@click.pass_obj
def cancel(obj: Ctx, batch: str) -> None:
    """Cancel BATCH: its jobs not yet started end as `cancelled`; running ones finish."""
    if not obj.client.cancel(batch):
        fail(f"no batch {batch!r}", RET_NOT_FOUND)
    click.echo(f"batch {batch}: jobs not yet started are withdrawn")


@cli.command()
@click.argument("batch")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@click.pass_context
def resume(ctx: click.Context, batch: str, as_json: bool, quiet: bool) -> None:
    """Send the rest of BATCH, which its canary paused, from the file it was submitted from,
    with the options it was submitted with."""
    _check_batch(batch)
    client = ctx.obj.client
    st = client.store.status(batch)
    if st is None:
        fail(f"no batch {batch!r}", RET_NOT_FOUND)
    if not st.paused:
        fail(f"batch {batch} is not paused", RET_USAGE)
    source = client.store.feed_state(batch)[2]
    if source and not os.path.isabs(source):  # an uploaded file's id: `vqueue serve` feeds it
        client.store.unpause(batch)
        _say(f"batch {batch}: resumed; the API server that fed it sends the rest of {source}")
        return
    if not source or not os.path.isfile(source):
        fail(
            f"batch {batch} was submitted from {source or 'stdin'}, which is not here to read; "
            f"submit that input again with --batch {batch}",
            RET_INPUT,
        )
    options = client.store.unpause(batch)
    if options is None:
        fail(f"batch {batch} is not paused", RET_USAGE)
    _say(f"batch {batch}: resumed; sending the rest of {source}")
    ctx.invoke(
        submit, file=source, batch_id=batch, as_json=as_json, quiet=quiet,
        priority=options.get("priority"), system=options.get("system"),
        no_cache=bool(options.get("no_cache")),
    )  # fmt: skip


# ------------------------------------------------------------------------------- serve, keys
@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.pass_obj
def serve(obj: Ctx, host: str, port: int) -> None:
    """Serve OpenAI's Files and Batches API over the queue (docs/http-api.md)."""
    from importlib.util import find_spec

    # found, not imported: the server's modules load only once it starts
    lacking = [m for m in ("fastapi", "uvicorn", "python_multipart") if find_spec(m) is None]
    if lacking:
        fail(
            f"the HTTP API needs the server extra ({', '.join(lacking)} not installed): "
            "pip install 'vqueue[server]'", RET_USAGE,
        )  # fmt: skip
    from .http import serve as run

    click.echo(f"vqueue: serving the Batch API on http://{host}:{port}/v1", err=True)
    run(host, port, obj.settings)


@cli.group()
def keys() -> None:
    """API keys of `vqueue serve`: each maps to a tenant; stored hashed."""


@keys.command("create")
@click.argument("tenant")
@click.pass_obj
def keys_create(obj: Ctx, tenant: str) -> None:
    """Print a new API key for TENANT (shown once; only its digest is kept)."""
    from .http import ApiStore

    click.echo(ApiStore(obj.settings).create_key(tenant))


@keys.command("revoke")
@click.argument("tenant")
@click.pass_obj
def keys_revoke(obj: Ctx, tenant: str) -> None:
    """Revoke every API key of TENANT."""
    from .http import ApiStore

    n = ApiStore(obj.settings).revoke(tenant)
    if not n:
        fail(f"tenant {tenant!r} has no keys", RET_NOT_FOUND)
    click.echo(f"revoked {n} key(s) of {tenant}")


# ----------------------------------------------------------------------------------- schema
@cli.command()
@click.option(
    "--kind",
    type=click.Choice(["job", "result", "openai", "openai-completions", "openai-responses"]),
    default="job",
    show_default=True,
    help="Which model's JSON Schema.",
)
def schema(kind: str) -> None:
    """Print the JSON Schema of an input line (or of a result), for non-Python producers."""
    from schemas import BatchRequestInput, CompletionRequestInput, ResponsesRequestInput

    if kind == "job":
        out = job_json_schema()
    elif kind == "result":
        out = JobResult.model_json_schema()
    elif kind == "openai":
        out = BatchRequestInput.model_json_schema()
    elif kind == "openai-completions":
        out = CompletionRequestInput.model_json_schema()
    else:
        out = ResponsesRequestInput.model_json_schema()
    click.echo(json.dumps(out, indent=2))


# ----------------------------------------------------------------------------------- worker
@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def worker(obj: Ctx, args: tuple[str, ...]) -> None:
    """Start a worker: one persistent vLLM engine, fed by Celery processes.

    'vqueue worker --help' lists its options. The worker is its own program (python -m worker),
    run in this process's place with --broker and --queue passed on: it exits with its own code.
    """
    env = dict(os.environ)
    env["VQUEUE_BROKER_URL"], env["VQUEUE_QUEUE"] = obj.settings.broker_url, obj.settings.queue
    argv = [sys.executable, "-m", "worker", *args]
    os.execvpe(argv[0], argv, env)


def main() -> None:
    cli(prog_name="vqueue")


if __name__ == "__main__":
    main()
