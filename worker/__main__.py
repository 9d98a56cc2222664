"""``vqueue worker`` (``python -m worker``): start a worker, or check what one would run with.

It sets up the environment (GPUs, metrics port, the pool's size, the urgent process) and runs
``celery worker`` in its own place, so a supervisor's signals and the exit code are Celery's
and the worker's (``protocol.exits``). The ``vqueue`` command runs this module in its own place
for ``vqueue worker``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn

import click
from pydantic import ValidationError

from protocol.exits import RET_CONFIG, RET_USAGE
from schemas import Settings, get_settings
from schemas.settings import describe_settings_error

from .vllm_ext.configure import device_bulk_processes, device_max_num_seqs


def _fail(message: str, code: int) -> NoReturn:
    click.secho(f"vqueue: {message}", fg="red", err=True)
    sys.exit(code)


@click.command(
    context_settings={"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}
)
@click.option(
    "--gpus", help="GPU ids for this worker, e.g. 0 or 0,1 (tensor parallel) [env VQUEUE_GPUS]"
)
@click.option("--model", help="HF id or local path [env VQUEUE_MODEL]")
@click.option("-c", "--concurrency", type=int, help="Jobs held at once [env VQUEUE_CONCURRENCY]")
@click.option("-n", "--hostname", help="Celery node name (default vqueue-gpuN@host)")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Prometheus port, 0 for none [env VQUEUE_METRICS_PORT; default 9808 + first GPU id]",
)
@click.option("-l", "--loglevel", default="INFO", show_default=True)
@click.option(
    "--check",
    is_flag=True,
    help="Start nothing: print vLLM, torch, the device and which optimizations this worker's "
    "engine would run with; exit 10 when the configuration cannot run.",
)
@click.option("--json", "as_json", is_flag=True, help="With --check: JSON output.")
@click.option("--check-here", is_flag=True, hidden=True)
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
def main(
    gpus: str | None,
    model: str | None,
    concurrency: int | None,
    hostname: str | None,
    metrics_port: int | None,
    loglevel: str,
    check: bool,
    as_json: bool,
    check_here: bool,
    celery_args: tuple[str, ...],
) -> None:
    """Start a worker: one persistent vLLM engine, fed by its Celery process.

    One more Celery process, a second client of the same engine core, takes urgent jobs
    beyond the worker's share (VQUEUE_URGENT_CONCURRENCY); the worker starts it and stops it.

    Extra arguments go to the first process's 'celery worker' unchanged.
    """
    if check_here:
        _check(as_json)
        return
    try:
        s = get_settings()
    except ValidationError as exc:
        _fail(f"invalid settings: {describe_settings_error(exc)}", RET_USAGE)
    if s.engine_class.startswith("worker.engine:") and (missing := _missing_engine()):
        _fail(
            f"this worker cannot run: {missing} is not installed; install the worker's extra: "
            "pip install 'vqueue[gpu]' (CUDA) or 'vqueue[cpu]' (README)", RET_CONFIG,
        )  # fmt: skip
    env = _environment(s, gpus, model, concurrency, metrics_port)
    gpus = gpus or s.gpus
    if check:
        env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the report's
        argv = [sys.executable, "-m", "worker", "--check-here"]
        os.execvpe(sys.executable, argv + (["--json"] if as_json else []), env)
    ws = _resolved(s, env, concurrency)
    from celery.utils.nodenames import host_format

    name = host_format(
        hostname or (f"vqueue-gpu{gpus.replace(',', '-')}@%h" if gpus else "vqueue@%h")
    )
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker.app",
        "worker",
        # threads, not prefork: the engine lives in this process and vLLM must spawn children
        "--pool",
        "threads",
        "--concurrency",  # its share, where more bulk processes take the rest (worker.app.Lane)
        str(ws.bulk_share()),
        # the shared queue; the worker adds its own and the urgent one (worker/app.py)
        "--queues",
        ws.queue,
        "--hostname",
        name,
        "--loglevel",
        loglevel,
        *(["--task-events"] if ws.task_events else []),  # else Flower turns them on
        "--without-mingle",
        "--without-gossip",
        *celery_args,
    ]
    os.execvpe(argv[0], argv, env)


def _environment(
    s: Settings, gpus: str | None, model: str | None, concurrency: int | None,
    metrics_port: int | None,
) -> dict[str, str]:  # fmt: skip
    """The environment the worker's processes run in: the command's options over settings,
    as the ``VQUEUE_*`` variables every process (and vLLM's) reads."""
    env = dict(os.environ)
    env["VQUEUE_BROKER_URL"], env["VQUEUE_QUEUE"] = s.broker_url, s.queue
    gpus = gpus or s.gpus
    if gpus is not None:
        ids = [g.strip() for g in gpus.split(",") if g.strip()]
        if not ids or not all(g.isdigit() for g in ids):
            _fail(f"--gpus takes GPU ids like 0 or 0,1, not {gpus!r}", RET_USAGE)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        env.setdefault("VQUEUE_TENSOR_PARALLEL_SIZE", str(len(ids)))
    if metrics_port is not None:
        env["VQUEUE_METRICS_PORT"] = str(metrics_port)
    elif gpus is not None and "VQUEUE_METRICS_PORT" not in os.environ and s.metrics_port:
        # one worker per GPU on a host: each needs its own port
        env["VQUEUE_METRICS_PORT"] = str(s.metrics_port + int(ids[0]))
    if model:
        env["VQUEUE_MODEL"] = model
    if concurrency:
        env["VQUEUE_CONCURRENCY"] = str(concurrency)
    # vLLM starts its engine core as a child process; fork in a threaded process can deadlock.
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return env


def _resolved(s: Settings, env: dict[str, str], concurrency: int | None) -> Settings:
    """The worker's settings with the device's defaults resolved once, here, and handed to
    every process in ``env``: the pool's size follows ``max_num_seqs``, and each lane must
    read the same bulk process count."""
    ws = s.model_copy(update={"concurrency": concurrency} if concurrency else {})
    if s.max_num_seqs is None and not ws.concurrency:
        # the pool is 2 x max_num_seqs: resolve the device's default now, for both
        if "CUDA_VISIBLE_DEVICES" in env:  # the device this worker will run on
            os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        env["VQUEUE_MAX_NUM_SEQS"] = str(device_max_num_seqs())
        ws = ws.model_copy(update={"max_num_seqs": int(env["VQUEUE_MAX_NUM_SEQS"])})
    if s.bulk_processes is None:  # the device's default, resolved once for every lane
        env["VQUEUE_BULK_PROCESSES"] = str(device_bulk_processes())
        ws = ws.model_copy(update={"bulk_processes": int(env["VQUEUE_BULK_PROCESSES"])})
    if ws.urgent_concurrency or (ws.bulk_processes or 1) > 1:  # lanes' metrics are served here
        import tempfile

        env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="vqueue-metrics-")
    return ws


def _missing_engine() -> str | None:
    """The first package vLLM's engine needs that this environment lacks (a producer-only
    install, ``pip install vqueue`` without an extra), found without importing it."""
    from importlib.util import find_spec

    return next(
        (name for name in ("torch", "vllm", "transformers") if find_spec(name) is None), None
    )


def _check(as_json: bool) -> None:
    """``vqueue worker --check``, in the worker's environment (GPUs, model, settings)."""
    import logging

    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    from .vllm_ext.configure import ConfigError, check

    try:
        settings = get_settings()
        report = check(settings)
    except ValidationError as exc:
        _fail(f"invalid settings: {describe_settings_error(exc)}", RET_CONFIG)
    except (ConfigError, FileNotFoundError) as exc:
        _fail(f"this worker cannot run: {exc}", RET_CONFIG)
    except Exception as exc:  # noqa: BLE001  # vLLM refusing the model or the engine arguments
        _fail(f"this worker cannot run: {type(exc).__name__}: {exc}", RET_CONFIG)
    from .sandbox import sandbox_problem

    sandbox = sandbox_problem()  # codegen jobs with tests run only where this is None
    report["tests_sandbox"] = "bwrap" if sandbox is None else f"unavailable: {sandbox}"
    if as_json:
        click.echo(json.dumps(report))
        return
    keys = ("vllm", "torch", "device", "gpus", "model", "model_path", "quantization", "dtype")
    for key in (*keys, "kv_cache_dtype", "plugin_registered"):
        click.echo(f"{key:<18} {report[key]}")
    click.echo(f"{'model_runner':<18} {report['model_runner']}")
    click.echo(f"{'early_stop':<18} {report['monitor']}")
    for key in ("guided_batching", "grammar_reuse", "mask_reorder", "loop_check"):
        click.echo(f"{key:<18} {'on' if report[key] else 'off'}")
    order = report["urgent_order"]
    click.echo(f"{'urgent_preempt':<18} {'off' if order is None else f'vLLM priority <= {order}'}")
    click.echo(f"{'tests_sandbox':<18} {report['tests_sandbox']}")
    for name, why in report["missing"].items():
        click.echo(f"{'not installed':<18} {name}: {why}")
    click.echo(f"{'status':<18} {'DEGRADED' if report['degraded'] else 'ok'}")


if __name__ == "__main__":
    main(prog_name="vqueue worker")
