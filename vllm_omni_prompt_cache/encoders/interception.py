"""How a text encoder's calls are intercepted: before any hook (vLLM-Omni's offload, a placement) or its forward.

While a cache is installed, each text encoder (and each module between it and its token tables, which code may call
directly: ``text_encoder.model``) has its class swapped for a same-named subclass whose ``__call__`` hands the
*outermost* call of each thread to the cache's :class:`Intercepted` server; a call made while another intercepted
call runs on the thread (the encoder's own layers, a part called by the whole) goes through as before. A plain
method of the encoder's own classes that code calls from outside (MiniMax-H3's ``encode_ids``) is served the same
way once it was seen to reach a hooked module; one that never did runs as it is. Nothing here knows about keys or
the store.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any, Protocol

import torch

_local = threading.local()  # .depth: how many intercepted calls run on this thread now


class Intercepted(Protocol):
    def __call__(
        self, path: str, module: torch.nn.Module, run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict
    ) -> Any:
        """Serve one outermost call of ``module`` (at ``path``); ``run(args, kwargs)`` makes a real call of it."""


def inside_encoder() -> bool:
    """Return True while an intercepted call runs on this thread."""
    return bool(getattr(_local, "depth", 0))


def run_inside(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``call`` as an intercepted call's real run: the calls it makes of hooked modules go through."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        return call(*args, **kwargs)
    finally:
        _local.depth -= 1


_lock = threading.Lock()
#: id of an intercepted module -> (its path, the server, its class before the swap)
_targets: dict[int, tuple[str, Intercepted, type]] = {}
_classes: dict[type, type] = {}
#: which own methods of an encoder class were seen to reach a hooked module (True), or not (False)
_encodes: dict[tuple[type, str], bool] = {}


def intercept(modules: list[tuple[str, torch.nn.Module, bool]], server: Intercepted) -> None:
    """Hand the outermost calls of each ``(path, module, is_encoder)`` to ``server`` until :func:`release`; an
    encoder's own methods too."""
    with _lock:
        for path, module, encoder in modules:
            held = _targets.get(id(module))
            original = held[2] if held is not None else type(module)
            _targets[id(module)] = (path, server, original)
            if held is None:
                object.__setattr__(module, "__class__", _intercepting_class(original, encoder))


def release(modules: list[torch.nn.Module]) -> None:
    """Give each module its class back."""
    with _lock:
        for module in modules:
            held = _targets.pop(id(module), None)
            if held is not None and type(module) is _classes.get(held[2]):
                object.__setattr__(module, "__class__", held[2])


def _intercepting_class(kind: type, encoder: bool) -> type:
    found = _classes.get(kind)
    if found is not None:
        return found
    call = kind.__call__

    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        target = _targets.get(id(self))
        if target is None or getattr(_local, "depth", 0):
            return call(self, *args, **kwargs)
        path, server, _ = target
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
        target = _targets.get(id(self))
        if target is None or getattr(_local, "depth", 0) or _encodes.get((kind, name)) is False:
            return original(self, *args, **kwargs)
        path, server, _ = target
        if _encodes.get((kind, name)):
            real = lambda given, named: run_inside(original, self, *given, **named)  # noqa: E731
            return server(f"{path}:{name}", self, real, args, kwargs)
        _local.reached = False
        result = run_inside(_noting_reach, original, self, *args, **kwargs)
        _encodes[(kind, name)] = bool(getattr(_local, "reached", False))
        return result

    method.__name__ = name
    return method


def _noting_reach(original: Callable[..., Any], self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run an encoder's own method the first time, noting whether it calls a hooked module (see :func:`reached`)."""
    handles = [
        module.register_forward_pre_hook(_reach)
        for module in self.modules()
        if id(module) in _targets
    ]
    try:
        return original(self, *args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def _reach(module: torch.nn.Module, args: tuple) -> None:
    _local.reached = True
