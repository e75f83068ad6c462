"""Hooking helpers: run a function when a module is imported; replace an attribute once.

The plugin must rebind names inside vLLM-Omni modules without importing them itself: importing
the diffusion stack costs about a second, and plain vLLM processes never need it. A meta-path
finder wraps the loader of each awaited module and runs the callbacks right after the module's
own code, before any importer binds names from it.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

_MARK = "_prompt_cache_hooked"
_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
_lock = threading.RLock()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it already is."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _callbacks.setdefault(name, []).append(callback)
            if not any(isinstance(finder, _PostImportFinder) for finder in sys.meta_path):
                sys.meta_path.insert(0, _PostImportFinder())
            return
    _run(callback, module)


def replace_once(owner: Any, name: str, wrap: Callable[[Any], Any]) -> bool:
    """Set ``owner.name = wrap(current)`` unless a previous call already did; return whether it did.

    For a class, ``current`` is the class's own attribute (a function, or a classmethod object);
    for an instance, the attribute as looked up. Plugins load many times, in many processes: the
    mark on the replacement keeps every wrapper from being applied twice. A class or module that
    lacks ``name`` (another vLLM-Omni version) is said once, as a warning, and left alone.
    """
    current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if current is None:
        if isinstance(owner, (type, ModuleType)):  # a hook point of vLLM-Omni's that is not there
            where = owner.__name__ if isinstance(owner, ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
            logger.warning("vllm-omni-prompt-cache: %s has no %s to hook; that part stays stock.", where, name)
        return False
    if getattr(current, _MARK, False):
        return False
    replacement = wrap(current)
    setattr(replacement, _MARK, True)
    setattr(owner, name, replacement)
    return True


def _run(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # a hook must never break the import it rides on
        logger.exception("vllm-omni-prompt-cache: hook %s on %s failed", callback.__qualname__, module.__name__)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PostImportLoader(spec.loader, fullname)
        return spec


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            callbacks = _callbacks.pop(self._name, [])
        for callback in callbacks:
            _run(callback, module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for inspect and pkgutil
        return getattr(self._loader, name)
