"""The settings resolved: one immutable :class:`PromptEmbedCacheSettings` from keyword arguments, serve flags,
environment variables and defaults (an environment variable overrides the keyword argument or flag, which
overrides the default), and upstream's ``resolve_prompt_embed_cache_config``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

from vllm_omni_prompt_cache.errors import PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.settings import values
from vllm_omni_prompt_cache.settings.schema import (
    DIRECTORY,
    DIRECTORY_GROUP,
    DIRECTORY_KEY_FILE,
    ENABLE,
    REMOVED,
    SETTINGS,
    by_field,
    carried_settings,
)
from vllm_omni_prompt_cache.store.tiers.directory_trust import KEY_ENV, key_id, read_key


def env_flag(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Return the boolean environment variable ``name`` (``default`` when unset); raise if malformed."""
    environ = os.environ if environ is None else environ
    if name not in environ:
        return default
    parsed = values.bool_from_text(environ[name])
    if parsed is not None:
        return parsed
    raise PromptEmbedCacheConfigError(
        f"invalid {name}={environ[name]!r} from the environment: expected 1/0, true/false, yes/no or on/off"
    )


def _settings_from(values: Mapping[str, Any], sources: Mapping[str, str], key: str | None) -> PromptEmbedCacheSettings:
    """Rebuild a pickled or copied :class:`PromptEmbedCacheSettings` from the values it held."""
    settings = object.__new__(PromptEmbedCacheSettings)
    object.__setattr__(settings, "_values", {**_defaults(), **values})
    object.__setattr__(settings, "sources", dict(sources))
    object.__setattr__(settings, "directory_key_id", key)
    return settings


def _defaults() -> dict[str, Any]:
    return {setting.field: copy.copy(setting.default) for setting in SETTINGS}


#: The key of :meth:`PromptEmbedCacheSettings.as_dict` that carries the signing key's id.
KEY_ID = "directory_key_id"


class PromptEmbedCacheSettings:
    """Every setting resolved once, with where each value came from (for logs and errors): one attribute per
    entry of :data:`SETTINGS`, by its ``field`` (``settings.max_bytes``), its default where not given.

    This one value travels whole from the engine's constructor to the diffusion worker
    (:meth:`as_dict` / :meth:`from_dict`: plain values, so any stage config can carry it), and is what
    :func:`~.wrapper.install_prompt_embed_cache` takes. Immutable: :meth:`replace` makes a changed copy.
    """

    __slots__ = ("_values", "directory_key_id", "sources")

    def __init__(
        self,
        *,
        sources: Mapping[str, str] | None = None,
        directory_key_id: str | None = None,
        **values: Any,
    ) -> None:
        known = by_field()
        unknown = set(values) - set(known)
        for name in sorted(unknown & set(REMOVED)):
            raise PromptEmbedCacheConfigError(f"the setting {name} given as a keyword argument was {REMOVED[name]}")
        if unknown:
            raise TypeError(f"unknown prompt-embed cache setting(s) {sorted(unknown)}: expected {', '.join(known)}")
        resolved = {name: copy.copy(setting.default) for name, setting in known.items()}
        for name, value in values.items():
            setting = known[name]
            # Given in code only: checked here, no other source checks it. A carried value is checked where it
            # comes from (resolution, from_dict); given directly, it is taken as the keyword was before the
            # settings object (a directory that cannot be written leaves the calls served, uncached on disk).
            if not setting.carried and value is not None:
                setting.parse(value, "keyword argument")
            resolved[name] = value
        object.__setattr__(self, "_values", resolved)
        object.__setattr__(self, "sources", dict(sources or {}))
        object.__setattr__(self, "directory_key_id", directory_key_id)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle and copy as the values held, not parsed again (a directory is not created twice)."""
        return _settings_from, (self._values, self.sources, self.directory_key_id)

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: use replace({name}=...)")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptEmbedCacheSettings):
            return NotImplemented
        return (self._values, self.sources, self.directory_key_id) == (
            other._values,
            other.sources,
            other.directory_key_id,
        )

    __hash__ = None  # type: ignore[assignment]  # mappings among its values

    def __repr__(self) -> str:
        given = ", ".join(f"{name}={value!r}" for name, value in self._values.items())
        return f"{type(self).__name__}({given})"

    def replace(self, **changes: Any) -> PromptEmbedCacheSettings:
        """Return a copy with ``changes`` (by field; ``sources`` and ``directory_key_id`` too)."""
        sources = changes.pop("sources", self.sources)
        key_id_now = changes.pop("directory_key_id", self.directory_key_id)
        return PromptEmbedCacheSettings(**{**self._values, **changes}, sources=sources, directory_key_id=key_id_now)

    def as_dict(self) -> dict[str, Any]:
        """Return the settings as plain values keyed by setting name, plus their sources. Raises for a
        setting given in code only (a function, an object), which cannot travel."""
        for setting in SETTINGS:
            if not setting.carried and self._values[setting.field] is not None:
                raise PromptEmbedCacheConfigError(
                    f"{setting.name} is given in code only and cannot travel to another process; install the "
                    "cache with it in the process that holds the pipeline"
                )
        return {
            **{setting.name: setting.plain_value(self._values[setting.field]) for setting in carried_settings()},
            "sources": dict(self.sources),
            KEY_ID: self.directory_key_id,
        }

    @classmethod
    def from_dict(cls, carried: Mapping[str, Any], source: str) -> PromptEmbedCacheSettings:
        """Return the settings :meth:`as_dict` wrote, validating each value again (it crossed a boundary)."""
        names = [setting.name for setting in carried_settings()]
        unknown = set(carried) - set(names) - {"sources", KEY_ID}
        if unknown:
            raise PromptEmbedCacheConfigError(
                f"unknown prompt-embed cache setting(s) {sorted(unknown)} in {source}: expected {', '.join(names)}"
            )
        values = {
            setting.field: setting.parse(carried[setting.name], f"{source} {setting.name}")
            for setting in carried_settings()
            if carried.get(setting.name) is not None
        }
        settings = _checked(cls(**values, sources=dict(carried.get("sources") or {})))
        if KEY_ID in carried and carried[KEY_ID] != settings.directory_key_id:
            held = "none" if settings.directory_key_id is None else f"another (id {settings.directory_key_id})"
            raise PromptEmbedCacheConfigError(
                f"the settings in {source} were resolved with directory signing key id {carried[KEY_ID]}, but this "
                f"process has {held}: give every process of the engine the same key ({KEY_ENV} or "
                f"{DIRECTORY_KEY_FILE.name})"
            )
        return settings


def resolve_settings(
    given: Mapping[str, Any],
    *,
    source: str = "keyword argument",
    environ: Mapping[str, str] | None = None,
) -> PromptEmbedCacheSettings:
    """Return every setting resolved from ``given`` (by setting name; None = not given) and the env.

    Each setting: its env var, else the given value, else its default.
    """
    settings = carried_settings()
    environ = os.environ if environ is None else environ
    for name in sorted(REMOVED):
        if name in environ or given.get(name) is not None:
            where = f"environment variable {name}" if name in environ else f"{source} {name}"
            raise PromptEmbedCacheConfigError(f"{where}: the setting was {REMOVED[name]}")
    unknown = set(given) - {setting.name for setting in settings}
    if unknown:
        raise PromptEmbedCacheConfigError(
            f"unknown prompt-embed cache setting(s) {sorted(unknown)} from {source}: "
            f"expected {', '.join(setting.name for setting in settings)}"
        )
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in settings:
        if setting.env in environ:
            origin = f"environment variable {setting.env}"
            values[setting.field] = setting.parse(environ[setting.env], origin)
        elif given.get(setting.name) is not None:
            origin = f"{source} {setting.name}"
            values[setting.field] = setting.parse(given[setting.name], origin)
        else:
            origin = "default"
        sources[setting.name] = origin
    return _checked(PromptEmbedCacheSettings(**values, sources=sources), environ)


def _checked(settings: PromptEmbedCacheSettings, environ: Mapping[str, str] | None = None) -> PromptEmbedCacheSettings:
    """Return ``settings`` with its signing key's id, once the directory's trust settings make sense
    together; raise naming them. A disabled cache checks nothing (a key exported fleet-wide is fine)."""
    if not settings.enabled:
        return settings
    source = settings.sources.get(DIRECTORY_KEY_FILE.name, "the stage's settings")
    environ = os.environ if environ is None else environ
    key = read_key(settings.directory_key_file, source, environ)  # raises for a bad or doubled key
    if settings.directory is None:
        given = [f"environment variable {KEY_ENV}"] if KEY_ENV in environ else []
        for setting in (DIRECTORY_KEY_FILE, DIRECTORY_GROUP):
            if getattr(settings, setting.field) is not None:
                given.append(f"{setting.name} from {settings.sources.get(setting.name, 'the stage settings')}")
        if given:
            raise PromptEmbedCacheConfigError(
                f"{' and '.join(given)} set, but {DIRECTORY.name} is not: they apply to the directory tier only "
                f"(give {DIRECTORY.name}, or unset them)"
            )
    return settings.replace(directory_key_id=key_id(key))


def resolve_prompt_embed_cache_settings(
    *,
    source: str = "keyword argument",
    environ: Mapping[str, str] | None = None,
    **given: Any,
) -> PromptEmbedCacheSettings:
    """Return every setting resolved: env var, else the given value (None = not given), else default.

    ``given``: values by the settings' field names (``max_bytes=...``, ``directory=...``), ``enable`` for
    :data:`ENABLE` as :func:`resolve_prompt_embed_cache_config` names it.
    """
    by_keyword = {setting.field: setting for setting in carried_settings()}
    by_keyword["enable"] = by_keyword.pop(ENABLE.field)
    unknown = set(given) - set(by_keyword)
    if unknown:
        raise TypeError(f"unknown setting(s) {sorted(unknown)}: expected {', '.join(by_keyword)}")
    named = {by_keyword[keyword].name: value for keyword, value in given.items()}
    return resolve_settings(named, source=source, environ=environ)


def resolve_prompt_embed_cache_config(
    enable: bool | None = None,
    max_size: int | None = None,
) -> tuple[bool, int]:
    """Return ``(enabled, max_size)`` with upstream's signature and env vars, but strict validation."""
    settings = resolve_prompt_embed_cache_settings(enable=enable, max_size=max_size)
    return settings.enabled, settings.max_size


#: Where docs/user-guide.md holds :func:`settings_table` (the lines between them are replaced whole).
