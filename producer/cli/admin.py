"""The other ``vqueue`` commands: dead letters, templates, ping, cancel, serve, keys, schema,
worker."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from pydantic import ValidationError

from protocol.exits import (
    RET_INPUT,
    RET_NOT_FOUND,
    RET_TIMEOUT,
    RET_USAGE,
)
from schemas import (
    JobResult,
    job_json_schema,
)

if TYPE_CHECKING:
    pass

from .base import (
    Ctx,
    cli,
    fail,
)


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
            from ..inputs import describe

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
    from ..http import serve as run

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
    from ..http import ApiStore

    click.echo(ApiStore(obj.settings).create_key(tenant))


@keys.command("revoke")
@click.argument("tenant")
@click.pass_obj
def keys_revoke(obj: Ctx, tenant: str) -> None:
    """Revoke every API key of TENANT."""
    from ..http import ApiStore

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
