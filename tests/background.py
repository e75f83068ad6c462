"""A second lane for the suite's slow, port-free subprocesses, so the 2-core machine's other core works too.

Most of the suite runs one thing at a time on one core. The slowest subprocesses (each imports vLLM,
about 15 s, or runs the coverage matrix) need no port and touch no shared state, so they can run
beside it. A test module names them in ``BACKGROUND_JOBS``: test name -> ``(key, function)``, the
arguments of :func:`submit`, or a function that calls it (for a job with arguments). Once
collection ends, ``conftest.py`` starts those of the selected tests, in test order, on one
background worker. The test then reads its job with :func:`result`, which waits for
it (or runs it, if nothing started it): what a test asserts and the commands it runs do not change,
only when the command starts. Engines and servers stay in the main lane.

A job must pass :func:`environment` to its subprocess, never inherit it: tests in the main lane
change ``os.environ`` (monkeypatch) while a job runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

#: One worker: a second lane beside the main one, not a pool (memory, and vLLM's import is CPU-bound).
_LANE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-lane")
_JOBS: dict[str, Future] = {}
_SCRATCH: list[Path] = []
_ENVIRONMENT: dict[str, str] = {}


def environment(**overrides: str) -> dict[str, str]:
    """Return the environment the suite started with (as ``os.environ`` is now, before any job was
    started), with ``overrides``: what the job's subprocess would have inherited in its test."""
    return {**(_ENVIRONMENT or os.environ), **overrides}


def submit(key: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
    """Start ``function(*args, **kwargs)`` in the background lane under ``key`` (once); return its future."""
    if key not in _JOBS:
        _JOBS[key] = _LANE.submit(function, *args, **kwargs)
    return _JOBS[key]


def result(key: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Return the job ``key``'s result, starting it first if nothing has (the arguments are the job's)."""
    return submit(key, function, *args, **kwargs).result()


def scratch_dir(prefix: str) -> Path:
    """Return a new directory for a background job's files (a test's ``tmp_path`` may not exist yet)."""
    path = Path(tempfile.mkdtemp(prefix=f"pytest-background-{prefix}-"))
    _SCRATCH.append(path)
    return path


def start_for(items: list) -> None:
    """Start the background jobs of the selected test items, in their order."""
    _ENVIRONMENT.update(os.environ)
    started: set[tuple[int, str]] = set()
    for item in items:
        module = getattr(item, "module", None)
        name = getattr(item, "originalname", None)
        job = getattr(module, "BACKGROUND_JOBS", {}).get(name)
        if job is not None and (id(module), name) not in started:
            started.add((id(module), name))
            if isinstance(job, tuple):
                submit(*job)
            else:
                job()


def finish() -> None:
    """Drop the jobs no test read, wait for the running one, remove the jobs' directories."""
    _LANE.shutdown(wait=True, cancel_futures=True)
    for path in _SCRATCH:
        shutil.rmtree(path, ignore_errors=True)
