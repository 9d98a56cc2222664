"""``vqueue status`` and ``vqueue results``: a batch's counts or the fleet's, a batch's results as
JSONL or a table."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import click

from protocol.exits import (
    RET_NOT_FOUND,
    RET_STALLED,
    RET_TIMEOUT,
    RET_USAGE,
)
from schemas import (
    BatchStatus,
    JobResult,
)

if TYPE_CHECKING:
    pass

from .base import (
    Ctx,
    _canary_words,
    _check_batch,
    _flush,
    _interrupted,
    _kept,
    _open_for_writing,
    _write_result,
    _written,
    cli,
    fail,
)


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
    from ..errors import BatchNotFound

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
    from ..batch import feed_stopped

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
    from protocol.routing import embed_queue, urgent_queue, worker_queue

    workers = client.store.workers(lanes=True)
    shared = {client.settings.queue, *(w["queue"] for w in workers if w.get("queue"))}
    shared |= {urgent_queue(q) for q in shared} | {embed_queue(q) for q in shared}
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
            + (" (embeddings)" if w.get("runner") == "pooling" else "")
            + f" queue={w.get('queue')} in_flight={w['in_flight']}/{w['concurrency']}"
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
    from ..errors import BatchNotFound, Stalled, WaitTimeout

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
