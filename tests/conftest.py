"""Test-wide set-up: the engine tests run vLLM-Omni on the CPU platform this package ships.

The platform is chosen when vLLM is first imported, so the opt-in is set here, before any test
module imports vLLM. It only applies to machines without an accelerator (CI, these dev boxes).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM", "1")
# Keep the engine's own logs readable in failures: no colour codes, no usage stats.
os.environ.setdefault("VLLM_LOGGING_COLOR", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
