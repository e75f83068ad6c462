"""The CPU platform's attention backend: vLLM-Omni's PyTorch SDPA with a CPU forward."""

from __future__ import annotations

import torch
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    """PyTorch SDPA, dispatched for the CPU (the base class only knows accelerator platforms)."""

    def forward(self, query, key, value, attn_metadata=None) -> torch.Tensor:
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CpuSDPABackend(SDPABackend):
    """vLLM-Omni's SDPA backend with a CPU forward."""

    @staticmethod
    def get_impl_cls() -> type[CpuSDPAImpl]:
        return CpuSDPAImpl
