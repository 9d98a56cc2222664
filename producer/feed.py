"""One JSONL input fed into one batch: read line by line, each good line made an envelope, the
canary's lines picked, the rest claimed and sent in chunks with the feed's position, the batch
sealed, and jobs lost on the way sent again from the input.

``vqueue submit`` (and ``vqueue resume``, which submits the rest) drives a ``Feed``; the CLI
keeps the options, the files it writes, the bars and the words. A line is rejected alone, never
the file: its parse error, a template nobody registered, a job that cannot be written
(``Client.envelope``), each told to ``on_reject`` with the line.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import redis

from schemas import Envelope

from .client import Batch, Client
from .errors import Gone, SubmissionStopped
from .inputs import Parsed, parse_line, parse_lines, read_lines

# how many input bytes pass between two calls of ``on_bytes``: a progress bar's update costs
# more than a line's parse
BYTES_EVERY = 65536


def _ignore(_p: Parsed, _error: str) -> None:
    """A second pass over the input (the canary's, a resend's) skips the lines the feed reports."""


class Feed:
    """``fh`` (the input, read once) into ``batch``. ``source``: the input's path, when it is a
    file that can be read again (the canary's pick, a resend); None for stdin. ``by_line``: its
    jobs are known by their line (the batch's own input), else by their id. ``skip``: the good
    lines a feed this one resumes sent already; they are checked, counted, and not sent.
    ``stop``: once set (the batch left Redis, the feed's lease is lost), the feed raises
    ``Gone`` at its next line."""

    def __init__(
        self,
        client: Client,
        batch: str,
        fh: BinaryIO,
        source: str | None,
        *,
        priority: int | None = None,
        system: str | None = None,
        cache: bool = True,
        by_line: bool = True,
        skip: int = 0,
        on_reject: Callable[[Parsed, str], None] = _ignore,
        on_bytes: Callable[[int], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.client, self.batch, self.fh, self.source = client, batch, fh, source
        self.priority, self.system, self.cache = priority, system, cache
        self.by_line, self.skip = by_line, skip
        self.on_reject, self.on_bytes, self.stop = on_reject, on_bytes, stop
        self.strict = client.settings.openai_strict
        self.good = 0  # good lines, those the resumed feed sent included
        self.rejected = 0

    # -- lines to envelopes
    def envelope(self, p: Parsed, on_bad: Callable[[Parsed, str], None]) -> Envelope | None:
        """The line's envelope; None for a bad line, told to ``on_bad``."""
        if p.error is not None or p.job is None:
            on_bad(p, p.error or "no job")
            return None
        try:
            line = p.line if self.by_line else None
            return self.client.envelope(
                p.job, self.batch, fmt=p.format, model=p.model, cache=self.cache, line=line
            )
        except ValueError as exc:
            on_bad(p, str(exc))
            return None

    def _reject(self, p: Parsed, error: str) -> None:
        self.rejected += 1
        self.on_reject(p, error)

    def _lines(self) -> Iterator[bytes]:
        pending = 0
        for raw in read_lines(self.fh):
            pending += len(raw)
            if self.on_bytes is not None and pending > BYTES_EVERY:
                self.on_bytes(pending)
                pending = 0
            yield raw
        if self.on_bytes is not None:
            self.on_bytes(pending)

    def envelopes(self) -> Iterator[Envelope]:
        """The good lines as envelopes, past ``skip``; bad ones are rejected here, so that
        ``rejected`` counts the whole input."""
        parsed = parse_lines(self._lines(), default_priority=self.priority,
                             default_system=self.system, strict=self.strict)  # fmt: skip
        for p in parsed:
            if self.stop is not None and self.stop.is_set():
                raise Gone(self.batch)
            if self.good < self.skip:  # sent by the feed this one resumes
                if p.error is None:
                    self.good += 1
                else:
                    self._reject(p, p.error)
                continue
            env = self.envelope(p, self._reject)
            if env is not None:
                self.good += 1
                yield env

    def _again(self) -> Iterator[Parsed]:
        """The input read again from the top (its path), parsed as the feed parses it."""
        assert self.source is not None
        with open(self.source, "rb") as again:
            yield from parse_lines(read_lines(again), default_priority=self.priority,
                                   default_system=self.system, strict=self.strict)  # fmt: skip

    # -- the canary
    def canary(self, share: float) -> list[Envelope]:
        """The canary's envelopes: ``share`` of the input's lines, spread over it
        (``producer.canary.pick``), each parsed alone; the feed parses the rest once."""
        from .canary import count_lines, first_owners, pick

        assert self.source is not None, "a canary needs its input as a file"
        source = self.source

        def parse(n: int, raw: bytes) -> Parsed:
            return parse_line(n, raw, self.priority, self.system, self.strict)

        def numbered() -> Iterator[tuple[int, bytes]]:
            with open(source, "rb") as again:
                yield from ((n, r) for n, r in enumerate(read_lines(again), 1) if r.strip())

        least = self.client.settings.canary_min_jobs
        some = pick(numbered(), share, least, count_lines(source), self.batch)
        chosen = {n: parse(n, raw) for n, raw in some}
        out = []
        for p in first_owners(chosen, numbered(), parse):
            env = self.envelope(p, _ignore)
            if env is not None:
                out.append(env)
        return out

    # -- sending
    def send(self, force: bool = False, started: threading.Event | None = None) -> Batch:
        """Send the input past ``skip`` and seal the batch (the whole input fed: no feed left
        to resume). Whatever stops it (Redis full or gone, a refusal, Ctrl-C), the jobs already
        sent still form a batch that finishes and can be read, sealed with what stopped it;
        the feed keeps its position, so the same input submitted again with the batch id goes
        on from there. ``started`` is set once the first jobs are in Redis."""
        store = self.client.store

        def first(_n: int) -> None:
            if started is not None:
                started.set()

        try:
            handle = self.client.submit_many(
                self.envelopes(), batch=self.batch, seal=False, force=force,
                position=self.skip, on_progress=first,
            )  # fmt: skip
            store.seal(self.batch, rejected=self.rejected, fed_all=True)
            return handle
        except SubmissionStopped as exc:
            with contextlib.suppress(redis.RedisError):  # the lines rejected, counted
                store.stop_submission(self.batch, exc.reason, self.rejected)
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                store.seal(self.batch, rejected=self.rejected)
            raise

    def resend(self) -> int:
        """Send again, from the input, the jobs of the batch lost on the way (a worker killed
        as it took them: ``Client.lost``); how many went."""
        jobs = (env for p in self._again() if (env := self.envelope(p, _ignore)) is not None)
        return self.client.resend(jobs, self.batch)


def run_in_thread(
    feed: Feed, force: bool, on_end: Callable[[], None] | None = None
) -> tuple[threading.Thread, threading.Event, dict[str, Any]]:
    """``feed.send`` on a thread of its own, so that its caller can follow results while the
    input is fed (a big input is fed as workers finish jobs): the thread, an event set once the
    first jobs are in Redis or the feed ended, and where its outcome lands (``handle`` or
    ``error``). ``on_end`` runs on that thread as the feed ends, however it ends."""
    started = threading.Event()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["handle"] = feed.send(force, started)
        except BaseException as exc:  # kept for the caller's thread
            outcome["error"] = exc
        finally:
            if on_end is not None:
                on_end()
            started.set()

    thread = threading.Thread(target=run, name="vqueue-feed", daemon=True)
    thread.start()
    return thread, started, outcome
