"""The CPU platform's attention backend: vLLM-Omni's PyTorch SDPA with a CPU forward."""

from __future__ import annotations

import torch
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


def _cpu_forward(self: SDPAImpl, query, key, value, attn_metadata=None) -> torch.Tensor:
    return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CpuSDPAImpl(SDPAImpl):
    """PyTorch SDPA, dispatched for the CPU (the base class only knows accelerator platforms)."""

    forward = _cpu_forward


class CpuSDPABackend(SDPABackend):
    """vLLM-Omni's SDPA backend with a CPU forward."""

    @staticmethod
    def get_impl_cls() -> type[CpuSDPAImpl]:
        return CpuSDPAImpl


def give_stock_sdpa_a_cpu_forward() -> None:
    """Make vLLM-Omni's own ``SDPAImpl`` run on the CPU platform too.

    vLLM-Omni 0.27 and 0.28 run float32 attention through a fallback they build from the stock
    ``SDPABackend`` whatever backend the platform chose, and the stock forward dispatches to the five
    built-in platforms only. Called where this platform chooses the backend, so only a process
    running on this platform is changed.
    """
    SDPAImpl.forward = _cpu_forward
