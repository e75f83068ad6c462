"""Which CPU a measurement ran on: the facts that decide how fast fp32 and bf16 kernels are."""

from __future__ import annotations

import os
import platform
from pathlib import Path

#: CPU flags that decide how fast bf16 and fp32 kernels run, in the order lscpu prints them.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
#: Environment variables that cap the instruction sets torch's kernels use (how an AVX2-only CPU is
#: timed on a newer one).
KERNEL_CAPS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def cpu_facts() -> tuple[str, list[str]]:
    """Return the CPU model and which of :data:`SPEED_FLAGS` it has (from /proc/cpuinfo on Linux)."""
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return platform.processor() or "unknown", []
    fields = {
        name.strip(): value.strip() for name, _, value in (line.partition(":") for line in first_cpu.splitlines())
    }
    flags = set(fields.get("flags", "").split())
    return fields.get("model name", "unknown"), [flag for flag in SPEED_FLAGS if flag in flags]


def cpu_summary() -> str:
    """Return one line: the CPU model, its speed flags, and any kernel caps in force."""
    model, present = cpu_facts()
    summary = f"{model}, flags: {' '.join(present) or 'none of ' + '/'.join(SPEED_FLAGS)}"
    caps = [f"{name}={os.environ[name]}" for name in KERNEL_CAPS if name in os.environ]
    return summary + (f", kernels capped with {' '.join(caps)}" if caps else "")
