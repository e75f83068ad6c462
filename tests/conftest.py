"""Test-wide set-up: where no GPU is visible, the engine tests run vLLM-Omni on our CPU platform.

The platform is chosen when vLLM is first imported, so the opt-in is decided here, before any
test module imports vLLM. On a machine with CUDA it stays off and the engine tests use the GPU
(the CPU-platform tests skip there). An explicit VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM wins.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

opt_in_where_no_gpu()
# Keep the engine's own logs readable in failures: no colour codes, no usage stats.
os.environ.setdefault("VLLM_LOGGING_COLOR", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected tests' slow port-free subprocesses in a second lane (see ``background.py``)."""
    import background

    if not session.config.option.collectonly:
        background.start_for(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import background

    background.finish()


@pytest.fixture(autouse=True)
def no_refuted_layouts_carry_over() -> Iterator[None]:
    """A layout a test refutes (a class an audit turns off) stays so in the process: start each test afresh."""
    from vllm_omni_prompt_cache import audit, proofs

    proofs._REFUTED.clear()
    audit.FAILED_CLASSES.clear()
    yield
    proofs._REFUTED.clear()
    audit.FAILED_CLASSES.clear()


@pytest.fixture
def accept_device_reporting_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the key encoder read ``device_reporting.ReportsCudaDevice`` as it reads a plain tensor."""
    from device_reporting import ReportsCudaDevice

    from vllm_omni_prompt_cache import keys

    monkeypatch.setattr(keys, "_PLAIN_TENSOR_TYPES", (*keys._PLAIN_TENSOR_TYPES, ReportsCudaDevice))
