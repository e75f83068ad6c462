"""How a written setting is read: booleans, sizes with units, fractions, paths, keys and method lists.

Each parser returns the value, or None where it is not allowed (the schema then raises
:class:`PromptEmbedCacheConfigError`, naming the setting, where the value came from and what is allowed).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_omni_prompt_cache.store.tiers.directory_trust import MIN_KEY_BYTES
from vllm_omni_prompt_cache.store.tiers.host import HOST_AT_SLEEP

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def bool_from_text(text: str) -> bool | None:
    """Return the boolean a user meant by ``text`` ('on', '0', ' Yes '...), or None if none."""
    text = text.strip().lower()
    return True if text in _TRUE else False if text in _FALSE else None


def boolean(value: Any) -> bool | None:
    return value if isinstance(value, bool) else bool_from_text(value) if isinstance(value, str) else None


def positive_int(value: Any) -> int | None:
    number = int(value.strip()) if isinstance(value, str) and value.strip().isdecimal() else value
    return number if isinstance(number, int) and not isinstance(number, bool) and number >= 1 else None


NO_LIMIT = object()  # what byte_budget returns for 'none': None already means "not valid"


def byte_budget(value: Any) -> Any:
    if value is None:
        return NO_LIMIT
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 1 else None
    if isinstance(value, str):
        if value.strip().lower() in ("none", "unlimited"):
            return NO_LIMIT
        match = _BYTES_PATTERN.match(value)
        if match and match.group(2).lower() in _UNITS:
            count = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            return count if count >= 1 else None
    return None


OFF = object()  # what host_budget returns for 'off'


def host_budget(value: Any) -> Any:
    """A host-memory budget: 'auto', a byte count >= 1 (units as for max_bytes) or 'off'; never unlimited."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("off", HOST_AT_SLEEP):
        return OFF if text == "off" else HOST_AT_SLEEP
    budget = byte_budget(value) if value is not None else None
    return None if budget is NO_LIMIT else budget


def directory(value: Any) -> Any:
    """A directory this process can create and write to, made absolute; 'off' for none."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        return None
    if value.strip().lower() == "off":
        return OFF
    path = Path(value.strip()).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(path) if path.is_dir() and os.access(path, os.W_OK | os.X_OK) else None


def fraction(value: Any) -> float | None:
    """A share of hits: a number in [0, 1] or a percentage ('5%'); 'off' is 0."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "off":
            return 0.0
        scale = 100.0 if text.endswith("%") else 1.0
        try:
            value = float(text.removesuffix("%")) / scale
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0.0 <= value <= 1.0 else None


def key_file(value: Any) -> str | None:
    """A file that exists, made absolute (what it holds is checked by directory_trust.read_key)."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        return None
    path = Path(value.strip()).expanduser().absolute()
    return str(path) if path.is_file() else None


def group(value: Any) -> int | None:
    """A group name or id of this machine that this process may give its files to."""
    import grp

    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    try:
        gid = int(text) if text.isdecimal() else grp.getgrnam(text).gr_gid if text else None
        if gid is not None:
            grp.getgrgid(gid)
    except (KeyError, OverflowError):
        return None
    if gid is None or not (os.geteuid() == 0 or gid == os.getegid() or gid in os.getgroups()):
        return None
    return gid


#: The cache implementations a stage can run: ours, or vLLM-Omni's own (for side-by-side comparisons).
BACKENDS = ("content-keyed", "vllm-omni")


def backend(value: Any) -> str | None:
    text = value.strip().lower() if isinstance(value, str) else None
    return text if text in BACKENDS else None


_CLASS_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")
_LAYOUT_REFERENCE = re.compile(r"^([a-z0-9][a-z0-9-]*|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$")


_METHOD_NAME = re.compile(r"^[A-Za-z_]\w*$")


def methods(value: Any) -> dict[str, tuple[str, ...]] | None:
    """Parse ``CLASS=METHOD[+METHOD...][,CLASS=...]`` (or a mapping): class paths to method names."""
    if isinstance(value, Mapping):
        pairs = []
        for name, methods in value.items():
            if isinstance(methods, (list, tuple)):
                if not methods or not all(isinstance(method, str) for method in methods):
                    return None
                methods = "+".join(methods)
            pairs.append((name, methods))
    elif isinstance(value, str):
        items = [item.strip() for item in value.split(",") if item.strip()]
        if not items or not all(item.count("=") == 1 for item in items):
            return None
        pairs = [tuple(part.strip() for part in item.split("=")) for item in items]
    else:
        return None
    declared: dict[str, tuple[str, ...]] = {}
    for class_path, names in pairs:
        if not isinstance(class_path, str) or not isinstance(names, str) or not _CLASS_PATH.match(class_path):
            return None
        methods = tuple(name.strip() for name in names.split("+"))
        if class_path in declared or not all(_METHOD_NAME.match(name) for name in methods):
            return None
        if len(set(methods)) != len(methods):
            return None
        declared[class_path] = methods
    return declared


def function(value: Any) -> Any:
    return value if callable(value) else None


def key_bytes(value: Any) -> bytes | None:
    return value if isinstance(value, bytes) and len(value) >= MIN_KEY_BYTES else None
