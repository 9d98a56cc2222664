"""Loaded by every Python process started with this folder on ``PYTHONPATH`` (the suite's
``--profile``): starts ``benchmarks/profiling/sampler.py`` in it when
``VQUEUE_BENCH_PROFILE_DIR`` is set. Loaded from its file: at start-up the project is not on
``sys.path`` yet.

With ``VQUEUE_BENCH_GC_DIR`` set, each process also appends every garbage collection that
stopped it for more than a millisecond to ``<dir>/gc-<pid>.tsv`` (wall time at its end,
generation, milliseconds, the start of its command line): whether collector pauses line up
with a row's slow jobs. One file per process: on a device call, keep the folder out of
``$OUT`` and bring back a tar of it."""

import os

if os.environ.get("VQUEUE_BENCH_PROFILE_DIR"):
    try:
        import importlib.util

        _path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "sampler.py")
        _spec = importlib.util.spec_from_file_location("vqueue_bench_sampler", _path)
        _sampler = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
        _spec.loader.exec_module(_sampler)  # type: ignore[union-attr]
        _sampler.start()
    except Exception:  # not profiled, rather than not started
        pass


if os.environ.get("VQUEUE_BENCH_GC_DIR"):
    import gc
    import sys
    import time

    _gc_file = os.path.join(os.environ["VQUEUE_BENCH_GC_DIR"], f"gc-{os.getpid()}.tsv")
    _gc_began = [0.0]

    def _gc_pause(phase: str, info: dict) -> None:
        if phase == "start":
            _gc_began[0] = time.perf_counter()
            return
        took = time.perf_counter() - _gc_began[0]
        if took > 0.001:
            who = " ".join(sys.argv[:3])[-80:].replace("\t", " ")
            with open(_gc_file, "a") as f:
                f.write(f"{time.time():.3f}\t{info['generation']}\t{took * 1e3:.1f}\t{who}\n")

    try:
        os.makedirs(os.environ["VQUEUE_BENCH_GC_DIR"], exist_ok=True)
        gc.callbacks.append(_gc_pause)
    except OSError:
        pass
