"""A text encoder as the cache holds it: its calls come to the cache first, and its own state is read on each.

**Interception.** While a cache is installed, each text encoder (and each module between it and its token tables,
which code may call directly: ``text_encoder.model``) has its class swapped for a same-named subclass whose
``__call__`` hands the *outermost* call on each thread to the cache's server (a :class:`Server`), before any hook
(vLLM-Omni's offload, a placement) or the forward runs; a call made while another intercepted call runs on the
thread (the encoder's own layers) goes through. A plain method of the encoder's own classes that code calls from
outside (MiniMax-H3's ``encode_ids``) is served the same way once it was seen to reach a hooked module. A module two
installed pipelines share is served by the one whose wrapped call runs on the thread, else by the one installed last.

**State.** An entry is what the encoder returned for those inputs *with its weights and settings then*. Some go into
each call's key: train or eval mode (dropout), the dtype of its parameters, and a digest of its ``config`` (an
attribute its forward reads, such as ``output_hidden_states`` or the attention implementation), made again only when
the configuration is seen to differ from what it held (each attribute by identity, containers by a copy). The rest is
checked on every call and empties the cache when it moved: a parameter written in place (its version counter:
``copy_`` under ``no_grad``, ``load_state_dict``; a buffer a forward writes is a cache of its own, such as a rotary
table), a parameter or submodule of it replaced or added (torch's global registration hooks: a weight replaced, a
LoRA layer injected), and a buffer replaced by one of other values. What this cannot see: a write through ``.data``
(no version counter moves); vLLM-Omni's weight loads and LoRA changes empty the cache on their own
(``vllm_omni/lifecycle.py``), and an audit catches the rest. Where the encoder sits (offload moves it every call) is
no part of its state: a hit is handed back on the device of the call's inputs.
Nothing here knows about keys or the store.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Server(Protocol):
    """What an intercepted call is handed to (:class:`~.encoder_calls.EncoderCalls`)."""

    local: threading.local  # .tally: a wrapped call of its pipeline runs on this thread

    def __call__(
        self, path: str, module: torch.nn.Module, run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict
    ) -> Any: ...

    def reached(self, method: str | None, args: tuple, kwargs: dict) -> None:
        """Count a call of an encoder's own method that, run for the first time, reached the encoder."""


_local = threading.local()  # .depth: how many intercepted calls run on this thread now

_swap_lock = threading.Lock()
#: id of an intercepted module -> (a weak reference to it, its class before the swap, {id of a server: (a weak reference
#: to it, the module's path there)}). A module two pipelines share is served by the one whose wrapped call runs on the
#: thread, else by the one installed last. Weak: a pipeline dropped without an uninstall leaves nothing alive here.
_targets: dict[int, tuple[weakref.ref, type, dict[int, tuple[weakref.ref, str]]]] = {}
_classes: dict[type, type] = {}
#: which own methods of an encoder class were seen to reach a hooked module (True), or not (False)
_encodes: dict[tuple[type, str], bool] = {}


def run_inside(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``call`` as an intercepted call's real run: the calls it makes of hooked modules go through."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        return call(*args, **kwargs)
    finally:
        _local.depth -= 1


def intercept(modules: list[tuple[str, torch.nn.Module, bool]], server: Server) -> None:
    """Hand the outermost calls of each ``(path, module, is_encoder)`` to ``server`` until :func:`release`; an
    encoder's own methods too."""
    with _swap_lock:
        for path, module, encoder in modules:
            held = _targets.get(id(module))
            if held is None or held[0]() is not module:
                kind = type(module)
                kind = next((original for original, made in _classes.items() if made is kind), kind)
                held = _targets[id(module)] = (weakref.ref(module), kind, {})
                object.__setattr__(module, "__class__", _intercepting_class(kind, encoder))
            held[2].pop(id(server), None)
            held[2][id(server)] = (weakref.ref(server), path)  # the last installed comes last


def release(modules: list[torch.nn.Module], server: Server) -> None:
    """Stop handing each module's calls to ``server``; give it its class back when no server is left."""
    with _swap_lock:
        for module in modules:
            held = _targets.get(id(module))
            if held is None or held[0]() is not module:
                continue
            held[2].pop(id(server), None)
            if not any(ref() is not None for ref, _ in held[2].values()):
                del _targets[id(module)]
                if type(module) is _classes.get(held[1]):
                    object.__setattr__(module, "__class__", held[1])


def _server_of(module: torch.nn.Module) -> tuple[Server, str] | None:
    held = _targets.get(id(module))
    if held is None:
        return None
    servers = [(ref(), path) for ref, path in list(held[2].values())]
    servers = [(server, path) for server, path in servers if server is not None]
    if len(servers) > 1:
        for server, path in servers:
            if getattr(server.local, "tally", None) is not None:
                return server, path
    return servers[-1] if servers else None


def _intercepting_class(kind: type, encoder: bool) -> type:
    found = _classes.get(kind)
    if found is not None:
        return found
    call = kind.__call__

    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        target = None if getattr(_local, "depth", 0) else _server_of(self)
        if target is None:
            return call(self, *args, **kwargs)
        server, path = target
        return server(path, self, lambda given, named: run_inside(call, self, *given, **named), args, kwargs)

    namespace: dict[str, Any] = {"__call__": __call__, "__slots__": (), "__module__": kind.__module__}
    if encoder:
        namespace.update((name, _intercepting_method(kind, name)) for name in _own_methods(kind))
    found = type(kind.__name__, (kind,), namespace)
    found.__qualname__ = kind.__qualname__
    _classes[kind] = found
    return found


def _own_methods(kind: type) -> list[str]:
    """Return the names of the plain methods ``kind`` and its bases define below ``torch.nn.Module``."""
    names: dict[str, None] = {}
    for base in kind.__mro__:
        if base is torch.nn.Module or base is object:
            break
        for name, value in vars(base).items():
            if not name.startswith("__") and type(value) is types.FunctionType:
                names.setdefault(name)
    return list(names)


def _intercepting_method(kind: type, name: str) -> Callable[..., Any]:
    original = getattr(kind, name)

    def method(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        target = None if getattr(_local, "depth", 0) or _encodes.get((kind, name)) is False else _server_of(self)
        if target is None:
            return original(self, *args, **kwargs)
        server, path = target
        if _encodes.get((kind, name)):
            real = lambda given, named: run_inside(original, self, *given, **named)  # noqa: E731
            return server(f"{path}:{name}", self, real, args, kwargs)
        _local.reached = False  # its first call: does it reach a hooked module?
        handles = [part.register_forward_pre_hook(_reach) for part in self.modules() if id(part) in _targets]
        try:
            result = run_inside(original, self, *args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        reached = _encodes[(kind, name)] = bool(getattr(_local, "reached", False))
        if reached:  # it ran the encoder: counted as an encoder call that encoded
            counted = getattr(server.local, "method", None) or f"{path}:{name}"
            server.reached(counted, args, kwargs)
        return result

    method.__name__ = name
    return method


def _reach(module: torch.nn.Module, args: tuple) -> None:
    _local.reached = True


# --- The encoder's own state -----------------------------------------------------------------------------------------

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
        self.types = tuple(map(type, self.values))
        self.objects = tuple(position for position, value in enumerate(self.values) if type(value) not in _PLAIN)
        self.copies = {name: _copied(value) for name, value in values.items() if isinstance(value, (list, dict, set))}
        self.nested = {name: _ConfigSeen(value) for name, value in values.items() if _attributes(value) is not None}

    def holds(self, config: Any) -> bool:
        if config is not self.config:
            return False
        values = _attributes(config)
        if values is None or tuple(values) != self.names:
            return False
        now = tuple(values.values())
        try:  # in C: each value the same object or equal, of the same type; objects of other types the same ones
            if now != self.values or tuple(map(type, now)) != self.types:
                return False
        except Exception:  # an attribute whose == gives no truth value (an array): it changed
            return False
        if not all(now[position] is self.values[position] for position in self.objects):
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
