"""A batch's life on the server: its input checked and fed, its counts and deadline moved along,
its results written to output files, cancel and expiry."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

from pydantic_core import to_json
from redis.exceptions import LockError
from redis.lock import Lock

from schemas import (
    BatchStatus,
    JobResult,
    output_line,
)
from schemas.api import (
    ENDPOINT_FORMAT,
    FINAL_STATES,
    BatchCreate,
    BatchError,
    BatchErrors,
    BatchObject,
    RequestCounts,
    window_seconds,
)

from ..errors import Gone
from ..feed import Feed
from ..inputs import parse_lines, read_lines
from .store import ApiStore, _private, _progress

log = logging.getLogger(__name__)

# at most this many line errors are kept on a failed batch (OpenAI's object is a short list)
MAX_BATCH_ERRORS = 100
# how an input line of each form is named when it is in a batch for another endpoint
LINE_KIND = {
    "vqueue": "vqueue job",
    "openai": "/v1/chat/completions",
    "openai_completions": "/v1/completions",
    "openai_responses": "/v1/responses",
    "openai_embeddings": "/v1/embeddings",
}


def uses_cache(b: BatchObject) -> bool:
    """A batch's jobs may be answered from the result cache unless its ``metadata`` says
    ``"cache": "false"`` (or off, no, 0)."""
    value = (b.metadata or {}).get("cache", "true").strip().lower()
    return value not in ("false", "off", "no", "0")


def canary_share(metadata: dict[str, str] | None) -> float | None:
    """The share of its input a batch runs first as a canary (``metadata`` ``"canary":
    "2%"``, producer/canary.py), or None; ``ValueError`` for a value that is not a share."""
    value = (metadata or {}).get("canary", "").strip()
    if not value:
        return None
    from ..canary import parse_share

    return parse_share(value)


CANCEL_GRACE_S = 30  # a cancelled batch's queued jobs left to the workers this long
DRAIN_BUDGET_S = 2.0  # a batch's results written out per turn of the mover, at most this long
LOST_CHECK_S = 30.0  # how often a batch that is not complete is asked whether jobs were lost


class Feeder:
    """Runs ``Batches.submit`` on a few threads, fairly: each tenant's batches wait in a line of
    their own, the threads serve the lines in turn, and one tenant runs at most ``per_tenant``
    at once, so a tenant's many big batches never keep another's one-line batch validating."""

    def __init__(self, run: Any, threads: int = 8, per_tenant: int = 2) -> None:
        self._run, self.per_tenant = run, per_tenant
        self._cond = threading.Condition()
        self._lines: dict[str, collections.deque[str]] = {}
        self._running: collections.Counter[str] = collections.Counter()
        self._known: set[str] = set()  # waiting or running here
        for i in range(threads):
            threading.Thread(target=self._work, name=f"vqueue-feeder-{i}", daemon=True).start()

    def feed(self, tenant: str, bid: str) -> None:
        """Queue the batch, unless it is waiting or running in this process already."""
        with self._cond:
            if bid in self._known:
                return
            self._known.add(bid)
            self._lines.setdefault(tenant, collections.deque()).append(bid)
            self._cond.notify()

    def _next(self) -> tuple[str, str] | None:
        for tenant in list(self._lines):  # the first tenant served goes to the back after
            if self._running[tenant] < self.per_tenant:
                line = self._lines.pop(tenant)
                bid = line.popleft()
                if line:
                    self._lines[tenant] = line
                return tenant, bid
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                while (turn := self._next()) is None:
                    self._cond.wait()
                tenant, bid = turn
                self._running[tenant] += 1
            try:
                self._run(tenant, bid)
            except Exception:  # submit fails its batch itself; this is a bug of ours
                log.exception("batch %s: feeding failed", bid)
            finally:
                with self._cond:
                    self._running[tenant] -= 1
                    self._known.discard(bid)
                    self._cond.notify_all()


class Batches:
    """What moves a batch through its states; every method is safe to call again."""

    def __init__(self, store: ApiStore) -> None:
        self.store = store
        self.settings = store.settings
        self.feeder = Feeder(self.submit)
        self._lost_checked: dict[str, float] = {}  # batch -> when Client.lost was last asked

    def create(self, tenant: str, req: BatchCreate) -> BatchObject:
        now = int(time.time())
        b = BatchObject(
            id="batch_" + secrets.token_hex(16),
            endpoint=req.endpoint,
            input_file_id=req.input_file_id,
            completion_window=req.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + window_seconds(req.completion_window),
            metadata=req.metadata,
            output_expires_after=req.output_expires_after,
        )
        self.store.save(tenant, b)
        return b

    def _lines(self, fh: Any) -> Iterator[Any]:
        fh.seek(0)
        yield from parse_lines(read_lines(fh), strict=self.settings.openai_strict)

    def submit(self, tenant: str, bid: str) -> None:
        """Check every line of the input file, then enqueue them all, or fail the batch; it
        runs off the request, so whatever goes wrong ends the batch ``failed``, saying why,
        never leaves it ``validating``. Its schemas are checked as this tenant's, so they never
        take every schema check from the others (``producer.grammar_check``)."""
        from .. import grammar_check

        as_tenant = grammar_check.tenant.set(tenant)
        try:
            with self.store.feed(bid, self.settings.api_feed_lease_s) as gone:
                if gone is not None:  # else another server process feeds it
                    self._submit(tenant, bid, gone)
        except Gone:
            log.warning("batch %s left Redis while it was fed; its feed stopped", bid)
        except Exception as exc:  # the file gone from disk, Redis away, a bug of ours
            if isinstance(exc, FileNotFoundError):
                error = BatchError(code="file_not_found", message="the input file was deleted")
            else:  # what went wrong is the operator's to read, in the server's log
                log.exception("batch %s: validation failed", bid)
                why = f"the server failed to check this batch's input; its log says why ({bid})"
                error = BatchError(code="server_error", message=why)
            self._update(
                tenant, bid, ("in_progress", "cancelling", *FINAL_STATES), status="failed",
                failed_at=int(time.time()), errors=BatchErrors(data=[error]),
            )  # fmt: skip
        finally:
            grammar_check.tenant.reset(as_tenant)

    def _submit(self, tenant: str, bid: str, gone: threading.Event) -> None:
        """Check the input, then send it; or, for a batch whose feed died with its process
        (``in_progress``, not sealed), send the rest from where that feed stopped."""
        found = self.store.batch(tenant, bid)
        if found is None:
            return
        b = found[1]
        if b.status != "validating" and not self._unfed(b):
            return
        # held open from here: a delete of the file cannot take it from under the batch
        with open(self.store.path(b.input_file_id), "rb") as fh:
            self._check_and_send(tenant, b, fh, gone)

    def _canary_waits(self, b: BatchObject) -> bool:
        """The batch's canary waits for its answers, which it reads from Redis: none leaves
        for the output file until they are judged."""
        return canary_share(b.metadata) is not None and not self.store.batches.canary_judged(b.id)

    def _unfed(self, b: BatchObject) -> bool:
        """In progress, but its input not all submitted (the batch store has not sealed it),
        and not paused by its canary."""
        if b.status != "in_progress" or self.store.batches.is_sealed(b.id):
            return False
        return not self.store.batches.is_paused(b.id)

    def _check_and_send(self, tenant: str, b: BatchObject, fh: Any, gone: threading.Event) -> None:
        from ..client import Client

        bid, s = b.id, self.settings
        client = Client(s, stop=gone, tenant=tenant, on_limit="wait")
        want = ENDPOINT_FORMAT[b.endpoint]
        if b.status == "in_progress":  # a feed resumed: its input was checked and counted
            if self._canary(client, b, fh, gone):
                self._send(client, b, fh, gone, self.store.batches.fed_position(bid))
            return
        ceiling, budget = s.priority_ceiling(tenant), s.token_budget(tenant)
        errors: list[BatchError] = []
        bad = total = 0
        for p in self._lines(fh):
            message = p.error
            if message is None and p.job.priority > ceiling:
                message = f"priority {p.job.priority} is over this tenant's ceiling of {ceiling}"
            if message is None and (asked := getattr(p.job, "max_tokens", 0) or 0) > budget:
                message = f"max_tokens {asked} is over this tenant's {budget}"
            if message is None and p.format != want:
                message = (f"a {LINE_KIND[p.format]} line in a batch for {b.endpoint}: its "
                           f"lines are {LINE_KIND[want]} lines")  # fmt: skip
            if message is None:
                message = client.template_problem(p.job)
            if message is not None:
                bad += 1
                if len(errors) < MAX_BATCH_ERRORS:
                    errors.append(BatchError(code="invalid_request", message=message, line=p.line))
            total += 1
        now = int(time.time())
        if bad or not total:
            if not total:
                errors.append(BatchError(code="empty_file", message="the input file has no lines"))
            self._update(
                tenant, bid, status="failed", failed_at=now, errors=BatchErrors(data=errors),
                request_counts=RequestCounts(total=total),
            )  # fmt: skip
            return
        if self.store.open_jobs(tenant, but=bid) + total > s.api_max_open_jobs:
            why = f"its {total} jobs would pass the tenant's {s.api_max_open_jobs} not finished"
            quota = BatchErrors(data=[BatchError(code="quota_exceeded", message=why)])
            self._update(tenant, bid, status="failed", failed_at=now, errors=quota,
                         request_counts=RequestCounts(total=total))  # fmt: skip
            return

        # the batch exists in the store before it is in_progress, so a cancel from now on
        # reaches its jobs
        client.store.create(
            bid, "vqueue", b.input_file_id, queue=self.settings.queue, expected=total
        )
        started = self._update(
            tenant, bid, ("cancelling", *FINAL_STATES), status="in_progress", in_progress_at=now,
            request_counts=RequestCounts(total=total),
        )  # fmt: skip
        if started is None or started.status != "in_progress":  # cancelled while validating
            self._update(tenant, bid, status="cancelled", cancelled_at=int(time.time()),
                         request_counts=RequestCounts(total=total))  # fmt: skip
            return
        if self._canary(client, b, fh, gone):
            self._send(client, b, fh, gone, 0)

    def _canary(self, client: Any, b: BatchObject, fh: Any, gone: threading.Event) -> bool:
        """Run the batch's canary, if its metadata asks for one and it has not run: whether
        the rest may be sent. Its lines are picked as ``vqueue submit --canary`` picks them
        (``Feed.canary``). One that fails pauses the batch (``BatchStore.canary_ended``) until
        ``vqueue resume`` or a cancel; a feed resumed after its process died runs the canary
        it did not finish, its jobs sent already skipped."""
        from ..canary import run

        share = canary_share(b.metadata)
        st = self.store.batches.status(b.id)
        if share is None or st is None:
            return True
        if st.canary is not None:  # judged before: a passed canary, or a resumed batch
            return not st.paused
        jobs = self._feed(client, b, fh, gone).canary(share)

        def tick(_st: BatchStatus) -> None:
            if gone.is_set():
                raise Gone(b.id)

        _sent, report = run(client, b.id, jobs, tick)  # read before any leaves (_canary_waits)
        self.store.batches.canary_ended(b.id, report)
        if not report.passed:
            log.warning("batch %s paused: its canary failed: %s", b.id, "; ".join(report.reasons))
        return report.passed

    def _feed(
        self, client: Any, b: BatchObject, fh: Any, gone: threading.Event, skip: int = 0
    ) -> Feed:
        """The batch's feed: its only input is its file, so its jobs are known by their line."""
        fh.seek(0)
        return Feed(client, b.id, fh, str(self.store.path(b.input_file_id)),
                    cache=uses_cache(b), skip=skip, stop=gone)  # fmt: skip

    def _send(self, client: Any, b: BatchObject, fh: Any, gone: threading.Event, skip: int) -> None:
        """Submit the input's jobs after the first ``skip``, recording the position as it goes
        (``producer.feed``), and seal the batch."""
        from ..errors import SubmissionStopped

        bid = b.id
        feed = self._feed(client, b, fh, gone, skip)
        try:
            feed.send()
        except SubmissionStopped as exc:  # Redis full or gone: what was sent still runs, and
            # the batch ends failed with the reason once it has (``advance``)
            log.error("batch %s: submission stopped: %s", bid, exc.reason)
        except Gone:
            raise
        except Exception:  # a limit refused, a bug of ours: likewise
            log.exception("batch %s: submission stopped", bid)
            why = f"the server stopped submitting this batch; its log says why ({bid})"
            client.store.stop_submission(bid, why)

    def _update(
        self, tenant: str, bid: str, unless: tuple[str, ...] = FINAL_STATES, **changes: Any
    ) -> BatchObject | None:
        return self.store.update(bid, unless, **changes)

    def cancel(self, tenant: str, bid: str) -> BatchObject | None:
        found = self.store.batch(tenant, bid)
        if found is None:
            return None
        b = found[1]
        if b.status in FINAL_STATES or b.status == "cancelling":
            return b
        # first the jobs (a batch still validating has none yet: submit sees the status)
        self.store.batches.withdraw(bid, "cancelled")
        if self.store.batches.unpause(bid) is not None:  # its canary failed: the rest never goes
            self.store.batches.seal(bid, fed_all=True)
        return self._update(
            tenant, bid, ("cancelling", *FINAL_STATES), status="cancelling",
            cancelling_at=int(time.time()),
        )  # fmt: skip

    def advance(self, bid: str) -> BatchObject | None:
        """Counts, deadline, and the end: output and error files, the final state."""
        found = self.store.batch(None, bid, live=False)
        if found is None:
            return None
        tenant, b = found
        if b.status in FINAL_STATES:
            return b
        if b.status in ("in_progress", "cancelling") and not self._canary_waits(b):
            # results leave Redis as they arrive
            with self.store.lock(bid) as mine:
                if mine:
                    with contextlib.suppress(LockError):  # lapsed: another process drains it
                        self._drain(b, mine, budget_s=DRAIN_BUDGET_S)
        if b.status == "validating" or self._unfed(b):
            return self.store.live(self._sweep(tenant, b))
        st = self.store.batches.status(bid)
        if st is None:  # the batch store expired it
            return self._update(tenant, bid, status="expired", expired_at=int(time.time()))
        now = int(time.time())
        changes = _progress(b, st)
        expiring = self.store.batches.withdrawn(bid) == "expired"
        if b.status == "in_progress" and b.expires_at and now >= b.expires_at and not expiring:
            self.store.batches.withdraw(bid, "expired")
        sealed = self.store.batches.is_sealed(bid)
        if sealed and st.done < st.total and self._close_withdrawn(bid):
            st = self.store.batches.status(bid) or st
            changes = _progress(b, st)
        if sealed and st.done < st.total:
            self._resend_lost(tenant, b)
        if not (sealed and st.done >= st.total):
            return b.model_copy(update=changes)  # counts are read live (ApiStore.live)
        with self.store.lock(bid) as mine:
            if not mine:
                return b.model_copy(update=changes)
            self._update(tenant, bid, status="finalizing", finalizing_at=now, **changes)
            try:
                out, err = self._write_outputs(tenant, b, mine)
            except LockError:  # the lease lapsed mid-write: its next holder ends the batch
                return b.model_copy(update=changes)
            # how it ended is what was withdrawn, if anything: the first of cancel and expiry;
            # else failed if submission stopped early (what did run is in the files)
            why = self.store.batches.withdrawn(bid)
            end = {"cancelled": "cancelled", "expired": "expired"}.get(why or "", "completed")
            if end == "completed" and st.error:
                end = "failed"
                stopped = BatchError(code="submission_failed", message=st.error)
                changes["errors"] = BatchErrors(data=[stopped])
            done = int(time.time())
            changes.update(output_file_id=out, error_file_id=err, status=end)
            changes[f"{end}_at"] = done
            return self._update(tenant, bid, **changes)

    def _resend_lost(self, tenant: str, b: BatchObject) -> None:
        """Jobs of the batch lost on the way (``Client.lost``: a worker killed as it took one)
        are sent again from the input file, so the batch ends; checked every
        ``LOST_CHECK_S`` per batch, under the batch's lock."""
        from ..client import Client

        now = time.monotonic()
        if now - self._lost_checked.get(b.id, -LOST_CHECK_S) < LOST_CHECK_S:
            return
        self._lost_checked[b.id] = now
        client = Client(self.settings, tenant=tenant, on_limit="wait")
        if not client.lost(b.id):
            return
        try:
            path = self.store.path(b.input_file_id)
            with self.store.lock(b.id) as mine, open(path, "rb") as fh:
                if not mine:
                    return
                sent = Feed(client, b.id, fh, str(path), cache=uses_cache(b)).resend()
        except FileNotFoundError:  # its input deleted: the batch ends at its window's end
            log.error("batch %s has lost jobs and its input file is gone", b.id)
            return
        log.warning("batch %s: %d job(s) were lost on the way (a worker killed as it took "
                    "them); sent again from its input", b.id, sent)  # fmt: skip

    def _close_withdrawn(self, bid: str) -> bool:
        """Whether the withdrawn batch's jobs without a result were closed here: at once when
        no live worker consumes its queue (none would take them), else once the workers had
        their turn (a cancelled job running is aborted within a second; an expired one runs
        to its end, at most ``job_timeout_s``) and some are still queued behind other work."""
        batches = self.store.batches
        why, at = batches.withdrawn(bid), batches.withdrawn_at(bid)
        if why not in ("cancelled", "expired") or at is None:
            return False
        grace = CANCEL_GRACE_S if why == "cancelled" else self.settings.job_timeout_s + 30
        if time.time() < at + grace and batches.consumed(batches.queue_of(bid)):
            return False
        if closed := batches.close_unstarted(bid):
            log.info("batch %s %s: closed %d job(s) no worker took", bid, why, closed)
        return True

    def _sweep(self, tenant: str, b: BatchObject) -> BatchObject:
        """A batch being checked or submitted: if no server process feeds it (its feeder died
        with its process), feed it here; past its deadline unchecked, it expires."""
        if self.store.feeding(b.id):
            return b
        if b.status == "validating" and b.expires_at and time.time() >= b.expires_at:
            why = "the completion window ended before the batch's input was checked"
            expired = BatchErrors(data=[BatchError(code="expired", message=why)])
            now = int(time.time())
            return self._update(tenant, b.id, status="expired", expired_at=now, errors=expired) or b
        self.feeder.feed(tenant, b.id)
        return b

    def _drain(self, b: BatchObject, lease: Lock, budget_s: float | None = None) -> dict[str, str]:
        """Append the batch's results recorded since the last call to its output and error
        files (OpenAI's lines, or vqueue's for ``/v1/vqueue/jobs``), then let them leave Redis:
        Redis holds a batch's results only until they are on disk here. The files' lengths and
        the last result written are recorded together after each write, and a call cut short
        (its process killed) is undone by cutting the files back to the recorded lengths, so
        every result is written once. The caller holds the batch's lock (``ApiStore.lock``),
        ``lease``, renewed after each page: once it is no longer this process's, the drain
        stops (``LockError``) before it writes again, and the next holder's cut undoes a page
        half written.
        ``budget_s``: stop after this long even if more results wait (the mover serves every
        batch in turn); None: until none is left. Returns the state: file ids, counts, sizes."""
        key = f"{self.store.p}:out:{b.id}"
        state = self.store.r.hgetall(key)
        if not state:
            state = {"ok": "file-" + secrets.token_hex(16), "err": "file-" + secrets.token_hex(16)}
            state.update(after="0-0", ok_bytes="0", err_bytes="0", ok_n="0", err_n="0")
            self.store.r.hset(key, mapping=state)
            self.store.r.expire(key, self.settings.result_ttl_s)
        page = self.store.batches.read(b.id, state["after"], count=1000)
        if not page:
            return state
        vqueue_lines = b.endpoint == "/v1/vqueue/jobs"
        files = {}
        try:
            for k in ("ok", "err"):
                path = self.store.path(state[k])
                files[k] = open(path, "r+b" if path.exists() else "wb", opener=_private)
                files[k].truncate(int(state[f"{k}_bytes"]))  # a cut-short write undone
                files[k].seek(int(state[f"{k}_bytes"]))
            started = time.monotonic()
            while page:
                counts = {"ok": 0, "err": 0}
                for _entry, r in page:
                    line = vqueue_line(r) if vqueue_lines else output_line(r)
                    k = "ok" if r.status == "completed" else "err"
                    files[k].write(to_json(line) + b"\n")  # pydantic's: fast on floats
                    counts[k] += 1
                for fh in files.values():
                    fh.flush()
                    os.fsync(fh.fileno())
                state["after"] = page[-1][0]
                for k in ("ok", "err"):
                    state[f"{k}_bytes"] = str(files[k].tell())
                    state[f"{k}_n"] = str(int(state[f"{k}_n"]) + counts[k])
                self.store.r.hset(key, mapping=state)
                self.store.batches.take(b.id, state["after"])
                lease.reacquire()
                if budget_s is not None and time.monotonic() - started > budget_s:
                    break
                page = self.store.batches.read(b.id, state["after"], count=1000)
        finally:
            for fh in files.values():
                fh.close()
        return state

    def _write_outputs(
        self, tenant: str, b: BatchObject, lease: Lock
    ) -> tuple[str | None, str | None]:
        """The output and error files, whole (``_drain``), registered as the tenant's files;
        one that got no line is removed."""
        state = self._drain(b, lease)
        names = {"ok": f"{b.id}_output.jsonl", "err": f"{b.id}_error.jsonl"}
        got: dict[str, str | None] = {}
        after = b.output_expires_after
        ttl = after.seconds if after else self.settings.api_output_ttl_s
        for k in names:
            path = self.store.path(state[k])
            if int(state[f"{k}_n"]):
                self.store.register(tenant, state[k], names[k], "batch_output", path.stat().st_size,
                                    ttl)  # fmt: skip
                got[k] = state[k]
            else:
                path.unlink(missing_ok=True)
                got[k] = None
        self.store.r.delete(f"{self.store.p}:out:{b.id}")
        return got["ok"], got["err"]

    def outputs(self, bid: str) -> dict[str, Any]:
        """What of a batch's results is on disk so far: file ids, lines, bytes (tests, ops)."""
        state = self.store.r.hgetall(f"{self.store.p}:out:{bid}")
        return {k: (v if k in ("ok", "err", "after") else int(v)) for k, v in state.items()}


def vqueue_line(r: JobResult) -> dict[str, Any]:
    """A vqueue job's result as a batch output line: the ``JobResult`` as the response body,
    less what would tell one tenant about the fleet or others' work: which worker ran it, and
    how much of its prompt was already cached."""
    body = r.model_dump(mode="json", exclude={"worker": True, "usage": {"cached_tokens"}})
    if r.status == "completed":
        return {
            "id": f"batch_req_{r.id}",
            "custom_id": r.id,
            "response": {"status_code": 200, "request_id": r.id, "body": body},
            "error": None,
        }
    err = r.error
    return {
        "id": f"batch_req_{r.id}",
        "custom_id": r.id,
        "response": None,
        "error": {"code": err.type if err else "error", "message": err.message if err else ""},
    }
