"""How the cache's settings resolve: keyword arguments, serve flags, environment variables.

Every setting has one name for each way to give it (see :data:`SETTINGS`) and
one precedence rule, upstream's: **an environment variable overrides the
keyword argument or flag, which overrides the default.** A bad value from any
source raises :class:`PromptEmbedCacheConfigError` naming the setting, where the
value came from and what is allowed; nothing is silently ignored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class PromptEmbedCacheConfigError(ValueError):
    """A prompt-embed-cache setting has a value that is not allowed."""


@dataclass(frozen=True)
class Setting:
    """One setting and its names as a keyword argument, a serve flag and an env var."""

    name: str  # AsyncOmni / Omni keyword argument and OmniDiffusionConfig field
    flag: str
    env: str
    default: Any
    allowed: str  # what a user may write, for error messages and --help
    help: str


ENABLE = Setting(
    "enable_prompt_embed_cache",
    "--enable-prompt-embed-cache",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE",
    False,
    "a boolean: 1/0, true/false, yes/no, on/off",
    "Cache text-encoder outputs of encode_prompt, keyed by argument content (tensors included).",
)
MAX_SIZE = Setting(
    "prompt_embed_cache_size",
    "--prompt-embed-cache-size",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE",
    32,
    "an integer >= 1 (number of cached encode_prompt results)",
    "Most encode_prompt results kept (LRU).",
)
MAX_BYTES = Setting(
    "prompt_embed_cache_max_bytes",
    "--prompt-embed-cache-max-bytes",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES",
    None,
    "a byte count >= 1, optionally with a unit (512MiB, 2GB, 1.5GiB), or 'none' for no limit",
    "Most bytes of cached tensors (embeddings plus verification bytes); default: no limit.",
)
VERIFY = Setting(
    "prompt_embed_cache_verify",
    "--prompt-embed-cache-verify",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_VERIFY",
    True,
    "a boolean: 1/0, true/false, yes/no, on/off",
    "Compare input bytes on every hit so a hash collision can never return a wrong embedding.",
)

SETTINGS: tuple[Setting, ...] = (ENABLE, MAX_SIZE, MAX_BYTES, VERIFY)

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


def _invalid(setting: Setting, value: Any, source: str) -> PromptEmbedCacheConfigError:
    return PromptEmbedCacheConfigError(f"invalid {setting.name}={value!r} from {source}: expected {setting.allowed}")


def _bool_from_text(text: str) -> bool | None:
    """Return the boolean a user meant by ``text`` ('on', '0', ' Yes '...), or None if none."""
    text = text.strip().lower()
    return True if text in _TRUE else False if text in _FALSE else None


def parse_bool(setting: Setting, value: Any, source: str) -> bool:
    """Return ``value`` as a bool; text such as 'on' or '0' is accepted, anything else raises."""
    parsed = value if isinstance(value, bool) else _bool_from_text(value) if isinstance(value, str) else None
    if parsed is None:
        raise _invalid(setting, value, source)
    return parsed


def env_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Return the boolean environment variable ``name`` (``default`` when unset); raise if malformed."""
    environ = os.environ if environ is None else environ
    if name not in environ:
        return default
    parsed = _bool_from_text(environ[name])
    if parsed is not None:
        return parsed
    raise PromptEmbedCacheConfigError(
        f"invalid {name}={environ[name]!r} from the environment: expected 1/0, true/false, yes/no or on/off"
    )


def parse_positive_int(setting: Setting, value: Any, source: str) -> int:
    """Return ``value`` as an int >= 1; bools, floats, 0, negatives and text raise."""
    number = int(value.strip()) if isinstance(value, str) and value.strip().isdecimal() else value
    if isinstance(number, int) and not isinstance(number, bool) and number >= 1:
        return number
    raise _invalid(setting, value, source)


def parse_byte_budget(setting: Setting, value: Any, source: str) -> int | None:
    """Return ``value`` as a byte count >= 1, or None for 'no limit'."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str):
        if value.strip().lower() in ("none", "unlimited"):
            return None
        match = _BYTES_PATTERN.match(value)
        if match and match.group(2).lower() in _UNITS:
            count = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if count >= 1:
                return count
    raise _invalid(setting, value, source)


_PARSERS: dict[str, Callable[[Setting, Any, str], Any]] = {
    ENABLE.name: parse_bool,
    MAX_SIZE.name: parse_positive_int,
    MAX_BYTES.name: parse_byte_budget,
    VERIFY.name: parse_bool,
}


def parse_setting(setting: Setting, value: Any, source: str) -> Any:
    """Return ``value`` validated for ``setting``; raise naming the setting and source if bad."""
    return _PARSERS[setting.name](setting, value, source)


@dataclass(frozen=True)
class PromptEmbedCacheSettings:
    """Resolved settings, with where each value came from (for logs and errors)."""

    enabled: bool
    max_size: int
    max_bytes: int | None
    verify: bool
    sources: Mapping[str, str]


def resolve_prompt_embed_cache_settings(
    *,
    enable: bool | str | None = None,
    max_size: int | str | None = None,
    max_bytes: int | str | None = None,
    verify: bool | str | None = None,
    source: str = "keyword argument",
    environ: Mapping[str, str] | None = None,
) -> PromptEmbedCacheSettings:
    """Return every setting resolved: env var, else the given value (None = not given), else default."""
    environ = os.environ if environ is None else environ
    given = {ENABLE.name: enable, MAX_SIZE.name: max_size, MAX_BYTES.name: max_bytes, VERIFY.name: verify}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        if setting.env in environ:
            origin = f"environment variable {setting.env}"
            values[setting.name] = parse_setting(setting, environ[setting.env], origin)
        elif given[setting.name] is not None:
            origin = f"{source} {setting.name}"
            values[setting.name] = parse_setting(setting, given[setting.name], origin)
        else:
            origin = "default"
            values[setting.name] = setting.default
        sources[setting.name] = origin
    return PromptEmbedCacheSettings(
        enabled=values[ENABLE.name],
        max_size=values[MAX_SIZE.name],
        max_bytes=values[MAX_BYTES.name],
        verify=values[VERIFY.name],
        sources=sources,
    )


def resolve_prompt_embed_cache_config(
    enable: bool | None = None,
    max_size: int | None = None,
) -> tuple[bool, int]:
    """Return ``(enabled, max_size)`` with upstream's signature and env vars, but strict validation."""
    settings = resolve_prompt_embed_cache_settings(enable=enable, max_size=max_size)
    return settings.enabled, settings.max_size
