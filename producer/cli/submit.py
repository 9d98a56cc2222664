"""``vqueue submit`` and ``vqueue resume``: a JSONL input into a batch (``producer.feed``), its
canary, following its results while the rest is fed."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import IO, TYPE_CHECKING, Any, BinaryIO

import click

from protocol.exits import (
    RET_INPUT,
    RET_INTERRUPTED,
    RET_NOT_FOUND,
    RET_PAUSED,
    RET_REFUSED,
    RET_STOPPED,
    RET_TIMEOUT,
    RET_USAGE,
)
from schemas import (
    BatchStatus,
    CanaryReport,
    Envelope,
    rejected_line,
)

if TYPE_CHECKING:
    from ..feed import Feed
    from ..inputs import Parsed

from .base import (
    MAX_ECHOED_ERRORS,
    Ctx,
    _bar,
    _canary_words,
    _check_batch,
    _follow,
    _interrupted,
    _kept,
    _open_for_writing,
    _say,
    _warn_if_nobody_consumes,
    cli,
    fail,
)


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
    from ..client import new_batch_id
    from ..feed import Feed
    from ..inputs import expected_lines

    share = _options_checked(file, wait, out_path, errors_path, batch_id, canary, take)
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

        reject = _rejecter(batch, bar, errors_out, lambda: feed.rejected)
        feed = Feed(
            client, batch, fh, source, priority=priority, system=system, cache=not no_cache,
            by_line=by_line, skip=skip, on_reject=reject, on_bytes=bar.update,
        )  # fmt: skip
        ran_canary = 0  # the canary's jobs, sent before the feed (which skips them)
        if share is not None and created:
            options = {"priority": priority, "system": system, "no_cache": no_cache}
            ran_canary = _canary_first(feed, share, bar, file, quiet, timeout, as_json, options)
        elif share is not None:
            _say(f"batch {batch} exists: no canary runs for the rest of its input")

        def follow(feeder: Any) -> BatchStatus:
            return _follow(
                client, batch, out_file, errors_out, quiet, timeout, take, feeder,
                _resender(feed, batch) if source else None,
            )  # fmt: skip

        outcome, st = _fed(feed, file, skip, force, bar, follow if wait else None, as_json)
        bar.close()
        _feed_failed(batch, outcome.get("error"))
        _submitted(client, feed, outcome["handle"], file, errors_path, created, ran_canary,
                   wait, as_json, st)  # fmt: skip


def _resender(feed: Feed, batch: str) -> Callable[[], None]:
    def resend() -> None:
        sent = feed.resend()
        _say(f"batch {batch}: {sent} job(s) were lost on the way (a worker "
             "killed as it took them); sent again")  # fmt: skip

    return resend


def _fed(
    feed: Feed, file: str, skip: int, force: bool, bar: Any,
    follow: Callable[[Any], BatchStatus] | None, as_json: bool,
) -> tuple[dict[str, Any], BatchStatus | None]:  # fmt: skip
    """Feed the input in a thread of its own and, with ``--wait`` (``follow``), read results
    while the rest is fed. Ctrl-C interrupts the wait, not a feed about to end; a feed cut
    short says how to send the rest."""
    from ..feed import run_in_thread

    st: BatchStatus | None = None
    # the input is read once the feed ends: its bar ends then, not after the wait
    feeder, started, outcome = run_in_thread(feed, force, on_end=bar.close)
    try:
        if follow is not None:
            while not started.wait(0.5):
                pass
            if feeder.is_alive() or (outcome.get("handle") and feed.good > 0):
                if not as_json:
                    click.echo(feed.batch)
                    sys.stdout.flush()
                st = follow(feeder)
        while feeder.is_alive():
            feeder.join(0.5)
    except KeyboardInterrupt:
        feeder.join(2.0)
        if feeder.is_alive():
            _say(f"the feed of batch {feed.batch} stopped after {feed.good - skip} more jobs; "
                 f"send the rest with: vqueue submit {file} --batch {feed.batch}")  # fmt: skip
            sys.exit(RET_INTERRUPTED)
        _interrupted(feed.batch)
    return outcome, st


def _options_checked(
    file: str, wait: bool, out_path: str | None, errors_path: str | None,
    batch_id: str | None, canary: str | None, take: bool,
) -> float | None:  # fmt: skip
    """Options that cannot go together, refused before anything is read (exit 2); the
    canary's share, if one is asked for."""
    share = None
    if canary is not None:
        from ..canary import parse_share

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
    return share


def _rejecter(
    batch: str, bar: Any, errors_out: IO[str] | None, rejected: Callable[[], int]
) -> Callable[[Parsed, str], None]:
    """What becomes of a bad line: echoed (the first few), and in the errors file in the
    line's own format, as its batch's failed results are."""
    from ..inputs import rejected_result

    def reject(p: Parsed, error: str) -> None:
        if rejected() <= MAX_ECHOED_ERRORS:
            bar.write(f"line {p.line}: {error}", file=sys.stderr)
        if errors_out:
            ident = p.custom_id or (p.job.id if p.job is not None else None)
            if p.format == "vqueue":
                errors_out.write(rejected_result(batch, p, ident, error).model_dump_json())
            else:
                errors_out.write(json.dumps(rejected_line(ident, p.line, error)))
            errors_out.write("\n")

    return reject


def _canary_first(
    feed: Feed, share: float, bar: Any, file: str, quiet: bool, timeout: float | None,
    as_json: bool, options: dict[str, Any],
) -> int:  # fmt: skip
    """Run the canary before the rest is sent: how many jobs it ran, once it passed; a canary
    that failed pauses the batch and exits 12 (its batch id on stdout, as on success)."""
    client, batch = feed.client, feed.batch
    sample = feed.canary(share)
    if not sample:
        bar.close()
        client.store.delete(batch)
        fail(f"{file}: no valid job among the canary's lines", RET_INPUT)
    ran, report = _canary(client, batch, sample, quiet, timeout)
    client.store.canary_ended(batch, report, options)
    if not report.passed:
        bar.close()
        if as_json:
            click.echo(json.dumps({"batch": batch, "paused": True,
                                   "canary": report.model_dump()}))  # fmt: skip
        else:
            click.echo(batch)
        fail(f"batch {batch} paused: {_canary_words(batch, report)}", RET_PAUSED)
    _say(f"batch {batch}: its canary passed ({report.summary()}); sending the rest")
    return ran


def _feed_failed(batch: str, exc: BaseException | None) -> None:
    """A feed that stopped early, as its exit code: a refusal at a limit (7), Redis refusing
    a chunk (11, the batch id on stdout: what was sent runs), else what it raised."""
    from ..errors import Refused, SubmissionStopped

    if exc is None:
        return
    if isinstance(exc, Refused):
        fail(f"{exc}; the jobs before it are enqueued in batch {batch}", RET_REFUSED)
    if isinstance(exc, SubmissionStopped):
        click.echo(batch)  # as on success: a script reads the batch id from stdout
        fail(str(exc), RET_STOPPED)
    raise exc


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
    from ..canary import run
    from ..errors import BatchNotFound, WaitTimeout

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


def _resume_at(client: Any, batch: str, source: str) -> int:
    """Where a feed of ``source`` into ``batch`` that did not finish stopped (its process
    killed, Redis full, Ctrl-C): the jobs before it are sent and are not sent again. Refuses
    while that feed still runs."""
    from ..batch import feed_stopped

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
