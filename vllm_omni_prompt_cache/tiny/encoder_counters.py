"""What reached a tiny pipeline's text encoder: the counts the demo and the tests compare.

A cache hit never reaches the encoder, so these counts are the ground truth the cache's own
statistics are checked against. :meth:`CountsEncoderRuns.count_encoder_calls` counts through hooks
on the encoder module itself, so every path into it is counted (the cached method's, a stock text
path's, a layout check's); pipelines that count at their one call site add to the fields directly.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

#: Each pipeline's counters, kept outside the pipeline: they are instruments, not state an encode reads
#: (the cache keys what an encode reads from its pipeline, see ``reads.py``; a profiler's counts are not that).
_COUNTS: weakref.WeakKeyDictionary[Any, dict[str, float]] = weakref.WeakKeyDictionary()


def _counter(name: str, doc: str) -> property:
    def read(self: Any) -> float:
        return _COUNTS.get(self, {}).get(name, 0)

    def write(self: Any, value: float) -> None:
        _COUNTS.setdefault(self, {})[name] = value

    return property(read, write, doc=doc)


class CountsEncoderRuns:
    """Mixin for a pipeline: its text-encoder counters, and ``text_encoder_counters()`` for the worker RPC."""

    encoder_runs = _counter("encoder_runs", "calls that reached the text encoder (cache hits do not)")
    encoder_rows = _counter("encoder_rows", "prompt rows those calls encoded: batching shows here, not in runs")
    encode_seconds = _counter("encode_seconds", "time inside the text encoder(s)")

    def text_encoder_counters(self) -> dict[str, float]:
        """Return how often, for how many rows and how long the text encoder ran (and in which process)."""
        return {
            "encoder_runs": self.encoder_runs,
            "encoder_rows": self.encoder_rows,
            "encode_seconds": self.encode_seconds,
            "pid": os.getpid(),
        }

    def count_encoder_calls(self, counted: torch.nn.Module, timed: Iterable[torch.nn.Module | None] = ()) -> None:
        """Count runs and rows of ``counted``'s forward (rows: its ids' first dimension), and time it and ``timed``."""
        counted.register_forward_pre_hook(self._count_call, with_kwargs=True)
        for encoder in {id(module): module for module in (counted, *timed) if module is not None}.values():
            encoder.register_forward_pre_hook(_start_clock)
            encoder.register_forward_hook(self._stop_clock)

    def _count_call(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.encoder_runs += 1
        self.encoder_rows += int(ids.shape[0]) if isinstance(ids, torch.Tensor) else 0

    def _stop_clock(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.encode_seconds += time.perf_counter() - module._encode_started


def _start_clock(module: torch.nn.Module, args: tuple) -> None:
    module._encode_started = time.perf_counter()
