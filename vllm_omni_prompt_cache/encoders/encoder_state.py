"""What of a text encoder's own state shapes its outputs beside its inputs: in a key, or a reason to empty the cache.

An entry is what the encoder returned for those inputs *with its weights and settings then*. Some go into each call's
key: train or eval mode (dropout), the dtype of its parameters, and a digest of its ``config`` (an attribute its
forward reads, such as ``output_hidden_states`` or the attention implementation), made again only when the
configuration is seen to differ from what it held (each attribute by identity, containers by a copy). The rest is checked on every call and empties the cache when
it moved: a parameter written in place (its version counter: ``copy_`` under ``no_grad``, ``load_state_dict``; a
buffer a forward writes is a cache of its own, such as a rotary table), a parameter or submodule of it replaced or
added (torch's global registration hooks: a weight replaced, a LoRA layer injected), and a buffer replaced by one of
other values. What this cannot see: a write through ``.data`` (no version counter moves); vLLM-Omni's weight loads
and LoRA changes empty the cache on their own (``vllm_omni/lifecycle.py``), and an audit catches the rest. Where the
encoder sits (offload moves it every call) is no part of its state: a hit is handed back on the device of the call's
inputs.
"""

from __future__ import annotations

import copy
import hashlib
import json
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
        self._parameters: list[torch.Tensor] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._versions = -1
        self._config: _ConfigSeen | None = None
        self._config_digest = ""
        self._lock = threading.Lock()
        self._changed()

    def key(self) -> tuple[tuple[bool, str, str], str | None]:
        """Return what enters each call's key (its mode, its parameters' dtype, a digest of its configuration), and
        why the outputs cached before may differ from its outputs now (None: they do not)."""
        changed = self._changed()
        first = self._tensors[0] if self._tensors else None
        return (self.module.training, "" if first is None else str(first.dtype), self._config_digest), changed

    def _changed(self) -> str | None:
        """Return why the encoder's outputs may differ from those cached before (and note its state now), or None."""
        with self._lock:
            why = None
            if _REGISTRATIONS[0] != self._registrations:
                parameters = list(self.module.parameters())
                buffers = dict(self.module.named_buffers())
                if self._registrations >= 0:
                    if [id(tensor) for tensor in parameters] != [id(tensor) for tensor in self._parameters]:
                        why = "a parameter or submodule of it was replaced or added"
                    elif buffers.keys() != self._buffers.keys() or not all(
                        _same_tensor(buffers[name], self._buffers[name]) for name in buffers
                    ):  # a buffer made again with the same values (a rotary table) changes nothing
                        why = "a buffer of it changed"
                self._registrations, self._parameters, self._buffers = _REGISTRATIONS[0], parameters, buffers
                self._tensors = [*parameters, *buffers.values()]
            versions = sum(tensor._version for tensor in self._parameters)
            if self._versions >= 0 and versions != self._versions:
                why = why or "its weights were written in place"
            self._versions = versions
            config = getattr(self.module, "config", None)
            if config is not None and (self._config is None or not self._config.holds(config)):
                self._config = _ConfigSeen(config)
                self._config_digest = _digest(config)
            return why


def _same_tensor(tensor: torch.Tensor, kept: torch.Tensor) -> bool:
    """A buffer made again with the same values (a rotary table a forward sets back in float32) is the same."""
    if tensor is kept:
        return True
    if (tensor.shape, tensor.device) != (kept.shape, kept.device):
        return False
    with torch.no_grad():
        return bool(torch.equal(tensor.to(kept.dtype), kept))


_PLAIN = (int, float, str, bool)


class _ConfigSeen:
    """What a configuration held when it was last seen, to tell on every call, cheaply, whether it changed: each
    attribute's value by identity (a number or string rebound to an equal one is the same), a container by a copy of
    its contents, a nested configuration (``text_config``) the same way."""

    def __init__(self, config: Any) -> None:
        self.config = config
        values = _attributes(config)
        self.names = tuple(values)
        self.values = tuple(values.values())
        self.copies = {name: _copied(value) for name, value in values.items() if isinstance(value, (list, dict, set))}
        self.nested = {name: _ConfigSeen(value) for name, value in values.items() if _attributes(value) is not None}

    def holds(self, config: Any) -> bool:
        if config is not self.config:
            return False
        values = _attributes(config)
        if values is None or tuple(values) != self.names:
            return False
        for now, then in zip(values.values(), self.values, strict=True):
            if now is not then and not (type(now) in _PLAIN and type(then) is type(now) and now == then):
                return False
        if any(values[name] != copy for name, copy in self.copies.items()):
            return False
        return all(seen.holds(values[name]) for name, seen in self.nested.items())


def _attributes(value: Any) -> dict[str, Any] | None:
    """Return a configuration object's attribute dict (a ``PretrainedConfig``, or any object with ``to_dict``)."""
    if not callable(getattr(type(value), "to_dict", None)):
        return None
    try:
        return object.__getattribute__(value, "__dict__")
    except AttributeError:
        return None


def _digest(config: Any) -> str:
    """Return a digest of a configuration's contents (``to_dict()`` where it has one), the same in every process."""
    try:
        contents = config.to_dict() if callable(getattr(config, "to_dict", None)) else vars(config)
        spelled = json.dumps(contents, sort_keys=True, default=repr)
    except Exception:  # a configuration that cannot be read: one digest per object seen
        spelled = f"unreadable {type(config).__qualname__} {id(config)}"
    return hashlib.blake2b(spelled.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _copied(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # a value that cannot be copied is compared with itself: taken as unchanged
        return value
