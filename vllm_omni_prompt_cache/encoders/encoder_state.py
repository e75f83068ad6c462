"""What of a text encoder's own state shapes its outputs beside its inputs: in a key, or a reason to empty the cache.

An entry is what the encoder returned for those inputs *with its weights and settings then*. The cheap parts go into
each call's key: train or eval mode (dropout) and the dtype of its parameters. The rest is checked on every call and
empties the cache when it moved: a parameter or buffer written in place (its version counter: ``copy_`` under
``no_grad``, ``load_state_dict``), a parameter, buffer or submodule registered anywhere (torch's global
registration hooks: a weight replaced, a LoRA layer injected), and the encoder's ``config`` (an attribute its
forward reads, such as ``output_hidden_states`` or the attention implementation). What this cannot see: a write
through ``.data`` (no version counter moves); vLLM-Omni's weight loads and LoRA changes empty the cache on their own
(``vllm_omni/lifecycle.py``). Where the encoder sits (offload moves it every call) is no part of its state: a hit is
handed back on the device of the call's inputs.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

#: Bumped whenever any module registers a parameter, buffer or submodule (in this process).
_REGISTRATIONS = [0]
_hooked = threading.Lock()
_registered = [False]


def _bump(*_: Any) -> None:
    _REGISTRATIONS[0] += 1


def _watch_registrations() -> None:
    with _hooked:
        if _registered[0]:
            return
        module = torch.nn.modules.module
        module.register_module_parameter_registration_hook(_bump)
        module.register_module_buffer_registration_hook(_bump)
        module.register_module_module_registration_hook(_bump)
        _registered[0] = True


class EncoderState:
    """One text encoder's state as its cached outputs depend on it."""

    def __init__(self, module: torch.nn.Module) -> None:
        _watch_registrations()
        self.module = module
        self._registrations = -1
        self._tensors: list[torch.Tensor] = []
        self._versions = -1
        self._config: Any = None
        self._lock = threading.Lock()
        self._changed()

    def key(self) -> tuple[tuple[bool, str], str | None]:
        """Return what enters each call's key (its mode and its parameters' dtype), and why the outputs cached before
        may differ from its outputs now (None: they do not)."""
        changed = self._changed()
        first = self._tensors[0] if self._tensors else None
        return (self.module.training, "" if first is None else str(first.dtype)), changed

    def _changed(self) -> str | None:
        """Return why the encoder's outputs may differ from those cached before (and note its state now), or None."""
        with self._lock:
            why = None
            if _REGISTRATIONS[0] != self._registrations:
                tensors = [*self.module.parameters(), *self.module.buffers()]
                if self._registrations >= 0 and [id(tensor) for tensor in tensors] != [id(t) for t in self._tensors]:
                    why = "a parameter, buffer or submodule of it was replaced or added"
                self._registrations, self._tensors = _REGISTRATIONS[0], tensors
            versions = sum(tensor._version for tensor in self._tensors)
            if self._versions >= 0 and versions != self._versions:
                why = why or "its weights were written in place"
            self._versions = versions
            config = getattr(self.module, "config", None)
            if config is not None and not _same(config, self._config):
                if self._config is not None:
                    why = why or "its configuration changed"
                self._config = _copied(config)
            return why


def _same(config: Any, kept: Any) -> bool:
    try:
        return kept is not None and type(config) is type(kept) and vars(config) == vars(kept)
    except Exception:  # a configuration that cannot be compared is taken as unchanged only if it is the same object
        return config is kept


def _copied(config: Any) -> Any:
    try:
        return copy.deepcopy(config)
    except Exception:
        return config
