"""Loaded by every Python process started with this folder on ``PYTHONPATH`` (the suite's
``--profile``): starts ``benchmarks/profiling/sampler.py`` in it when
``VQUEUE_BENCH_PROFILE_DIR`` is set. Loaded from its file: at start-up the project is not on
``sys.path`` yet."""

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
