"""Profiling helpers: every process sampling its own stacks (``sampler``, started by
``gpu_suite --profile`` through ``hook/sitecustomize.py``), sums of py-spy profiles (``stacks``,
``gil_profile``) and timers around vLLM's engine step (``step_timers``)."""
