"""Which classes the matrix must list: every one the installed vLLM-Omni ships with an encode method the cache wraps.

Every module under ``vllm_omni.diffusion.models`` is imported, in name order. A class counts when
it is defined there (under each name its module binds it to, so a registry alias such as
``LTX2DistilledPipeline`` counts too) and its MRO defines ``encode_prompt``, the method
:func:`~vllm_omni_prompt_cache.calls.methods.find_encode_methods` wraps on every pipeline (others
are found while a pipeline runs, see :mod:`vllm_omni_prompt_cache.calls.installation`). A class that
vLLM-Omni's diffusion registry does not name and that only serves as a base of other counted
classes (a mixin, a shared runtime) is a base, not a pipeline: it is reported apart.

A module that does not import here is recorded with the reason and with the encode methods its
source defines, read as text, so that a class it hides cannot go unnoticed.

Importing every model module costs about 18 s of CPU in a fresh process, a few seconds after the
coverage cases (which import most of them already); the result is cached for the process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import re
from pathlib import Path

from vllm_omni_prompt_cache.calls.methods import ENCODE_PROMPT

PACKAGE = "vllm_omni.diffusion.models"


@dataclasses.dataclass(frozen=True)
class Unimportable:
    """A module under :data:`PACKAGE` that does not import here, and what its source would have shown."""

    reason: str
    encode_methods: tuple[str, ...]  # the wrappable methods its files define (``def name(``), by text


@dataclasses.dataclass(frozen=True)
class Enumeration:
    """The classes of the installed vLLM-Omni that the cache can wrap, by name, sorted."""

    classes: dict[str, str]  # name -> class path (``module.qualname``): each needs a Case or a NotBuilt
    bases: dict[str, str]  # name -> class path: unregistered classes other counted classes inherit from
    unimportable: dict[str, Unimportable]  # module name -> why, and what it would define


def encode_methods(kind: type) -> tuple[str, ...]:
    """Return the methods of ``kind`` the cache would wrap (``encode_prompt`` first); empty if none."""
    return (ENCODE_PROMPT,) if callable(getattr(kind, ENCODE_PROMPT, None)) else ()


@functools.cache
def enumerate_classes() -> Enumeration:
    """Return every class the installed vLLM-Omni's diffusion models define with a wrappable encode method."""
    from vllm_omni.diffusion.registry import _DIFFUSION_MODELS

    package = importlib.import_module(PACKAGE)
    unimportable: dict[str, Unimportable] = {}
    modules = []
    found = sorted(pkgutil.walk_packages(package.__path__, f"{PACKAGE}.", onerror=lambda _: None), key=_name)
    for info in found:
        if any(info.name.startswith(f"{broken}.") for broken in unimportable):
            continue  # inside a package that did not import: counted with it
        try:
            modules.append(importlib.import_module(info.name))
        except Exception as error:  # a module that needs what this machine lacks: recorded, never guessed at
            said = re.sub(r" \(/[^)]*\)", "", str(error))[:200]  # without this machine's file paths
            unimportable[info.name] = Unimportable(f"{type(error).__name__}: {said}", _defined_in(info))
    counted: dict[str, type] = {}
    for module in modules:
        for name, value in sorted(vars(module).items()):
            if isinstance(value, type) and value.__module__ == module.__name__ and encode_methods(value):
                if counted.get(name, value) is not value:
                    name = _path(value)  # a second class of that name: listed by path, so no case claims it unseen
                counted[name] = value
    registered = {class_name for _, _, class_name in _DIFFUSION_MODELS.values()}
    inherited = {ancestor for kind in counted.values() for ancestor in kind.__mro__[1:]}
    bases = {name for name, kind in counted.items() if name not in registered and kind in inherited}
    return Enumeration(
        classes={name: _path(counted[name]) for name in sorted(counted) if name not in bases},
        bases={name: _path(counted[name]) for name in sorted(bases)},
        unimportable=unimportable,
    )


def _name(info: pkgutil.ModuleInfo) -> str:
    return info.name


def _path(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _defined_in(info: pkgutil.ModuleInfo) -> tuple[str, ...]:
    """Return the wrappable methods that the source of ``info`` (a module, or a package's files) defines."""
    spec = info.module_finder.find_spec(info.name.rpartition(".")[2], None)
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    if origin is None:
        return ()
    files = sorted(origin.parent.rglob("*.py")) if info.ispkg else [origin]
    names = (ENCODE_PROMPT,)
    source = "\n".join(path.read_text(errors="replace") for path in files)
    return tuple(name for name in names if re.search(rf"\bdef {re.escape(name)}\(", source))
