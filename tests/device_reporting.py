"""A CPU tensor that reports itself on ``cuda:0``: the device half of "the device never enters the key".

Without a GPU no real CUDA tensor exists, and a ``meta`` tensor or a second CPU device object
would not exercise the path that matters. This wrapper subclass reports ``cuda:0`` for
``.device`` / ``.is_cpu`` / ``.is_cuda`` and computes on the CPU tensor it holds; ``.cpu()`` returns
that tensor as a plain one. The key encoder reads it through the same branch as a real CUDA
tensor (not CPU, so it copies to the host once), which proves that branch and the key built after
it never read the device. It does not prove that a real device-to-host copy is exact:
``tests/test_cuda.py`` covers that on a GPU. The encoder refuses unknown subclasses, so tests
admit this one with the ``accept_device_reporting_tensors`` fixture (conftest.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

REPORTED_DEVICE = torch.device("cuda", 0)


class ReportsCudaDevice(torch.Tensor):
    """Reports ``cuda:0``; holds and computes on a CPU tensor."""

    held: torch.Tensor

    @staticmethod
    def __new__(cls, held: torch.Tensor) -> ReportsCudaDevice:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, held.shape, dtype=held.dtype, strides=held.stride(), device=REPORTED_DEVICE
        )
        wrapper.held = held
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*tree_map(_held, args), **tree_map(_held, kwargs))
        to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu")
        return result if to_host else tree_map(_wrapped, result)


def _held(value: Any) -> Any:
    return value.held if isinstance(value, ReportsCudaDevice) else value


def _wrapped(value: Any) -> Any:
    return ReportsCudaDevice(value) if type(value) is torch.Tensor else value
