"""How the cache's settings resolve: keyword arguments, serve flags, environment variables.

Every setting has one name for each way to give it (see :data:`SETTINGS`) and
one precedence rule, upstream's: **an environment variable overrides the
keyword argument or flag, which overrides the default.** A bad value from any
source raises :class:`PromptEmbedCacheConfigError` naming the setting, where the
value came from and what is allowed; nothing is silently ignored.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni_prompt_cache.directory_trust import KEY_ENV, MIN_KEY_BYTES, key_id, read_key
from vllm_omni_prompt_cache.errors import PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.host_tier import HOST_AT_SLEEP
from vllm_omni_prompt_cache.rows import RowLayout

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


def _bool_from_text(text: str) -> bool | None:
    """Return the boolean a user meant by ``text`` ('on', '0', ' Yes '...), or None if none."""
    text = text.strip().lower()
    return True if text in _TRUE else False if text in _FALSE else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else _bool_from_text(value) if isinstance(value, str) else None


def _positive_int(value: Any) -> int | None:
    number = int(value.strip()) if isinstance(value, str) and value.strip().isdecimal() else value
    return number if isinstance(number, int) and not isinstance(number, bool) and number >= 1 else None


_NO_LIMIT = object()  # what _byte_budget returns for 'none': None already means "not valid"


def _byte_budget(value: Any) -> Any:
    if value is None:
        return _NO_LIMIT
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 1 else None
    if isinstance(value, str):
        if value.strip().lower() in ("none", "unlimited"):
            return _NO_LIMIT
        match = _BYTES_PATTERN.match(value)
        if match and match.group(2).lower() in _UNITS:
            count = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            return count if count >= 1 else None
    return None


_OFF = object()  # what _host_budget returns for 'off'


def _host_budget(value: Any) -> Any:
    """A host-memory budget: 'auto', a byte count >= 1 (units as for max_bytes) or 'off'; never unlimited."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("off", HOST_AT_SLEEP):
        return _OFF if text == "off" else HOST_AT_SLEEP
    budget = _byte_budget(value) if value is not None else None
    return None if budget is _NO_LIMIT else budget


def _directory(value: Any) -> Any:
    """A directory this process can create and write to, made absolute; 'off' for none."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        return None
    if value.strip().lower() == "off":
        return _OFF
    path = Path(value.strip()).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(path) if path.is_dir() and os.access(path, os.W_OK | os.X_OK) else None


def _fraction(value: Any) -> float | None:
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


def _key_file(value: Any) -> str | None:
    """A file that exists, made absolute (what it holds is checked by directory_trust.read_key)."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        return None
    path = Path(value.strip()).expanduser().absolute()
    return str(path) if path.is_file() else None


def _group(value: Any) -> int | None:
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


def _backend(value: Any) -> str | None:
    text = value.strip().lower() if isinstance(value, str) else None
    return text if text in BACKENDS else None


_CLASS_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")
_LAYOUT_REFERENCE = re.compile(r"^([a-z0-9][a-z0-9-]*|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$")


def _row_layouts(value: Any) -> dict[str, Any] | None:
    """Parse ``CLASS=LAYOUT[,CLASS=LAYOUT...]`` (or a mapping): class paths to layout references, or, given in
    code, to :class:`~.rows.RowLayout` objects."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, str):
        items = [item.strip() for item in value.split(",") if item.strip()]
        if not all(item.count("=") == 1 for item in items):
            return None
        pairs = [tuple(part.strip() for part in item.split("=")) for item in items]
    else:
        return None
    layouts: dict[str, str] = {}
    for class_path, reference in pairs:
        if not isinstance(class_path, str) or not _CLASS_PATH.match(class_path) or class_path in layouts:
            return None
        if not isinstance(reference, RowLayout) and not (
            isinstance(reference, str) and _LAYOUT_REFERENCE.match(reference)
        ):
            return None
        layouts[class_path] = reference
    return layouts


_METHOD_NAME = re.compile(r"^[A-Za-z_]\w*$")


def _methods(value: Any) -> dict[str, tuple[str, ...]] | None:
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


def _function(value: Any) -> Any:
    return value if callable(value) else None


def _key_bytes(value: Any) -> bytes | None:
    return value if isinstance(value, bytes) and len(value) >= MIN_KEY_BYTES else None


@dataclass(frozen=True)
class Setting:
    """One setting: its names as a keyword argument, a serve flag and an env var, its parser, and how --help
    and the docs table show it. Everything a setting is made into (the kwargs, flags and env vars read, the
    settings object's attribute, ``install_prompt_embed_cache``'s use of it, the docs table) is read from here.

    A setting without an env var (``env=None``) is given in code only: a function or an object that cannot
    travel to another process (a digest function, a row layout object); it has no flag and no kwarg.
    """

    name: str  # AsyncOmni / Omni keyword argument and OmniDiffusionConfig field
    field: str  # the PromptEmbedCacheSettings attribute that holds it
    flag: str | None
    env: str | None
    default: Any
    allowed: str  # what a user may write, for error messages, --help and the docs table
    help: str
    convert: Callable[[Any], Any] = field(repr=False, default=lambda value: value)  # None: not allowed
    metavar: str | None = None  # the flag's value, as --help shows it; None: a boolean flag (--x / --no-x)
    shown_default: str | None = None  # the default as --help and the docs say it; None: from the value
    plain: Callable[[Any], Any] | None = field(repr=False, default=None)  # its value as plain data, if not itself
    none_written: str = "none"  # how None is written where the default is not None ("none": no limit)

    @property
    def carried(self) -> bool:
        """Return True for a setting users give (kwarg, flag, env var), which travels to the worker."""
        return self.env is not None

    @property
    def described_default(self) -> str:
        """Return the default as --help and the docs table say it."""
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None:
            return "no limit"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, dict):
            return "none"
        return str(self.default)

    def parse(self, value: Any, source: str) -> Any:
        """Return ``value`` validated; raise naming this setting, ``source`` and what is allowed."""
        parsed = self.convert(value)
        if parsed is None:
            raise PromptEmbedCacheConfigError(f"invalid {self.name}={value!r} from {source}: expected {self.allowed}")
        return None if parsed is _NO_LIMIT or parsed is _OFF else parsed

    def plain_value(self, value: Any) -> Any:
        """Return ``value`` as plain data that :meth:`parse` reads back (None would read as "not given")."""
        if value is None and self.default is not None:
            return self.none_written
        if self.plain is not None:
            return self.plain(value)
        return dict(value) if isinstance(value, Mapping) else value


_DIRECTORY_BYTES_DEFAULT = 16 * 2**30

ENABLE = Setting(
    "enable_prompt_embed_cache",
    "enabled",
    "--enable-prompt-embed-cache",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE",
    False,
    "a boolean: 1/0, true/false, yes/no, on/off",
    "Cache text-encoder outputs of encode_prompt, keyed by argument content (tensors included).",
    _bool,
)
MAX_SIZE = Setting(
    "prompt_embed_cache_size",
    "max_size",
    "--prompt-embed-cache-size",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE",
    32,
    "an integer >= 1 (number of cached encode_prompt results)",
    "Most encode_prompt results kept (LRU).",
    _positive_int,
    metavar="N",
)
MAX_BYTES = Setting(
    "prompt_embed_cache_max_bytes",
    "max_bytes",
    "--prompt-embed-cache-max-bytes",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_MAX_BYTES",
    None,
    "a byte count >= 1, optionally with a unit (512MiB, 2GB, 1.5GiB), or 'none' for no limit",
    "Most bytes of cached tensors (embeddings plus verification bytes); default: no limit.",
    _byte_budget,
    metavar="BYTES",
)
VERIFY = Setting(
    "prompt_embed_cache_verify",
    "verify",
    "--prompt-embed-cache-verify",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_VERIFY",
    True,
    "a boolean: 1/0, true/false, yes/no, on/off",
    "Compare input bytes on every hit so a hash collision can never return a wrong embedding.",
    _bool,
)
BACKEND = Setting(
    "prompt_embed_cache_backend",
    "backend",
    "--prompt-embed-cache-backend",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_BACKEND",
    "content-keyed",
    f"one of {', '.join(BACKENDS)}",
    "Which cache to install: this package's content-keyed one, or vLLM-Omni's own (to compare them).",
    _backend,
    metavar="{" + ",".join(BACKENDS) + "}",
)

ROW_LAYOUTS = Setting(
    "prompt_embed_cache_row_layouts",
    "row_layouts",
    "--prompt-embed-cache-row-layouts",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_ROW_LAYOUTS",
    {},
    "CLASS=LAYOUT pairs separated by commas: CLASS a pipeline class path (pkg.module.Class), LAYOUT the "
    "name of a proven layout (qwen-image-text, token-ids, qwen-image-token-ids, qwen-image-edit-token-ids) "
    "or pkg.module:NAME of a RowLayout; each class once",
    "Row layouts for pipeline classes you cannot edit; each is checked against the uncached call on first use.",
    _row_layouts,
    metavar="CLASS=LAYOUT[,...]",
)

METHODS = Setting(
    "prompt_embed_cache_methods",
    "methods",
    "--prompt-embed-cache-methods",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_METHODS",
    {},
    "CLASS=METHOD[+METHOD...] pairs separated by commas: CLASS a pipeline class path (pkg.module.Class), "
    "METHOD the name of a method of it that encodes prompts; each class once",
    "Encode methods to cache besides encode_prompt, for pipeline classes you cannot edit (each keyed, "
    "row-split and counted like encode_prompt; a method must depend only on its arguments).",
    _methods,
    metavar="CLASS=METHOD[+METHOD][,...]",
    plain=lambda declared: {class_path: "+".join(names) for class_path, names in declared.items()},
)

FIND_ENCODES = Setting(
    "prompt_embed_cache_find_encodes",
    "find_encodes",
    "--prompt-embed-cache-find-encodes",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_FIND_ENCODES",
    True,
    "a boolean: 1/0, true/false, yes/no, on/off",
    "Watch the pipeline's text encoders and cache the method that hands them their token ids, whatever it is "
    "called (checked on first use). Off: encode_prompt and the declared methods only.",
    _bool,
)

HOST_BYTES = Setting(
    "prompt_embed_cache_host_bytes",
    "host_bytes",
    "--prompt-embed-cache-host-bytes",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_HOST_BYTES",
    HOST_AT_SLEEP,
    f"'{HOST_AT_SLEEP}', a byte count >= 1, optionally with a unit (512MiB, 2GB, 1.5GiB), or 'off'",
    "Host-memory tier: entries leaving device memory move to host memory (pinned with CUDA), and a device miss "
    f"copies them back. '{HOST_AT_SLEEP}' (default): only the entries a level-1 sleep drops, within the device "
    "tier's own limits; a byte count: also entries its budgets evict, within that budget; 'off': a sleep "
    "clears the cache.",
    _host_budget,
    metavar="BYTES",
    shown_default="auto: a level-1 sleep's entries",
    none_written="off",
)
DIRECTORY = Setting(
    "prompt_embed_cache_dir",
    "directory",
    "--prompt-embed-cache-dir",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_DIR",
    None,
    "a directory path this process can create and write to (local disk or a filesystem every node mounts), or 'off'",
    "Directory tier: every encoded entry is also written there as a safetensors file, namespaced by the "
    "model's fingerprint; replicas, restarted engines and other nodes on that directory share them.",
    _directory,
    metavar="DIR",
    shown_default="off",
)
DIRECTORY_BYTES = Setting(
    "prompt_embed_cache_dir_bytes",
    "directory_bytes",
    "--prompt-embed-cache-dir-bytes",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_DIR_BYTES",
    _DIRECTORY_BYTES_DEFAULT,
    "a byte count >= 1, optionally with a unit (512MiB, 2GB, 1.5GiB), or 'none' for no limit",
    "Most bytes of files in the directory tier (least recently used files go first).",
    _byte_budget,
    metavar="BYTES",
    shown_default=f"{_DIRECTORY_BYTES_DEFAULT // 2**30}GiB",
)

DIRECTORY_KEY_FILE = Setting(
    "prompt_embed_cache_dir_key_file",
    "directory_key_file",
    "--prompt-embed-cache-dir-key-file",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_DIR_KEY_FILE",
    None,
    "the path of a file holding the directory's signing key (16 bytes or more; no access for others and no "
    "group write)",
    "Sign every file of the directory tier with this key (HMAC-SHA256) and refuse files without a valid "
    "signature. The key itself may instead be given in OMNI_DIFFUSION_PROMPT_EMBED_CACHE_DIR_KEY.",
    _key_file,
    metavar="FILE",
    shown_default="unsigned",
)
DIRECTORY_GROUP = Setting(
    "prompt_embed_cache_dir_group",
    "directory_group",
    "--prompt-embed-cache-dir-group",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_DIR_GROUP",
    None,
    "the name or id of a group of this machine that this user belongs to",
    "Create the directory tier's directories and files for this group (directories 2770, files 0660) so "
    "its members share them; default: no group or other write.",
    _group,
    metavar="GROUP",
    shown_default="none",
)

ENCODER_ON_MISS = Setting(
    "prompt_embed_cache_encoder_on_miss",
    "encoder_on_miss",
    "--prompt-embed-cache-encoder-on-miss",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_ENCODER_ON_MISS",
    False,
    "a boolean: 1/0, true/false, yes/no, on/off",
    "Keep the text encoders in one (pinned) host copy and place them on the device only while a cache miss "
    "encodes; the DiT stays resident. Not with vLLM-Omni offload that moves the text encoder.",
    _bool,
)

AUDIT = Setting(
    "prompt_embed_cache_audit",
    "audit",
    "--prompt-embed-cache-audit",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_AUDIT",
    0.0,
    "a fraction of hits between 0 and 1 (0.01, or 1%), or 'off' (0)",
    "Re-encode this share of hits and compare with what was served; a difference serves the fresh encode "
    "and turns the cache off for that pipeline class, with a warning.",
    _fraction,
    metavar="FRACTION",
    shown_default="off",
)

# Given in code only (no flag, no env var, no kwarg): functions and objects that stay in the process.
DIGEST = Setting(
    "digest",
    "digest",
    None,
    None,
    None,
    "a function from a buffer of tensor bytes to bytes",
    "Replaces xxh3-128 as the digest of tensor bytes (tests use a weak one to force collisions).",
    _function,
)
REPORT = Setting(
    "report",
    "report",
    None,
    None,
    None,
    "a function of the cache",
    "Runs after each call with the cache (the vLLM-Omni worker's rate-limited statistics log line).",
    _function,
)
ROW_LAYOUT = Setting(
    "row_layout",
    "row_layout",
    None,
    None,
    None,
    "a RowLayout",
    "encode_prompt's row layout, its author's word: its rows are served without a first-use check (anything else "
    "is refused with a warning when the cache is installed, and calls are keyed whole).",
)
DIRECTORY_KEY = Setting(
    "directory_key",
    "directory_key",
    None,
    None,
    None,
    f"bytes, {MIN_KEY_BYTES} or more",
    f"The directory tier's signing key itself (a worker reads it from {DIRECTORY_KEY_FILE.name} or {KEY_ENV}).",
    _key_bytes,
)

#: Every setting, in the order --help and the docs table show them.
SETTINGS: tuple[Setting, ...] = (
    ENABLE,
    MAX_SIZE,
    MAX_BYTES,
    VERIFY,
    BACKEND,
    ROW_LAYOUTS,
    METHODS,
    FIND_ENCODES,
    HOST_BYTES,
    DIRECTORY,
    DIRECTORY_BYTES,
    DIRECTORY_KEY_FILE,
    DIRECTORY_GROUP,
    ENCODER_ON_MISS,
    AUDIT,
    DIGEST,
    REPORT,
    ROW_LAYOUT,
    DIRECTORY_KEY,
)


def carried_settings() -> tuple[Setting, ...]:
    """Return the settings users give (kwargs, flags, env vars): those that travel to the worker."""
    return tuple(setting for setting in SETTINGS if setting.carried)


def _by_field() -> dict[str, Setting]:
    return {setting.field: setting for setting in SETTINGS}


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
        by_field = _by_field()
        unknown = set(values) - set(by_field)
        if unknown:
            raise TypeError(f"unknown prompt-embed cache setting(s) {sorted(unknown)}: expected {', '.join(by_field)}")
        resolved = {name: copy.copy(setting.default) for name, setting in by_field.items()}
        for name, value in values.items():
            setting = by_field[name]
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
        if any(not isinstance(reference, str) for reference in self._values[ROW_LAYOUTS.field].values()):
            raise PromptEmbedCacheConfigError(
                f"{ROW_LAYOUTS.name} holds a RowLayout object, which cannot travel to another process; name it "
                "instead (a proven layout's name, or pkg.module:NAME)"
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
    unknown = set(given) - {setting.name for setting in settings}
    if unknown:
        raise PromptEmbedCacheConfigError(
            f"unknown prompt-embed cache setting(s) {sorted(unknown)} from {source}: "
            f"expected {', '.join(setting.name for setting in settings)}"
        )
    environ = os.environ if environ is None else environ
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
TABLE_START = "<!-- settings table: made from config.SETTINGS by `make docs-table`; edit there -->"
TABLE_END = "<!-- end of the settings table -->"


def settings_table() -> str:
    """Return the Markdown table of every carried setting: kwarg, settings-object field, serve flag, env var,
    allowed, default."""
    rows = ["| kwarg | field | serve flag | env var | allowed | default |", "|---|---|---|---|---|---|"]
    for setting in carried_settings():
        if setting.metavar is None:
            flag = f"`{setting.flag}` / `--no-{setting.flag.removeprefix('--')}`"
        else:
            flag = f"`{setting.flag} {setting.metavar}`"
        allowed = setting.allowed.replace("|", "\\|")
        cells = (
            f"`{setting.name}`",
            f"`{setting.field}`",
            flag,
            f"`{setting.env}`",
            allowed,
            setting.described_default,
        )
        rows.append(f"| {' | '.join(cells)} |")
    rows.append(
        "| (none: the key itself) | `directory_key` (its bytes) | (none: a flag's value shows in `ps`) | "
        f"`{KEY_ENV}` | the signing key, {MIN_KEY_BYTES} bytes or more; not with the key file | unsigned |"
    )
    return "\n".join(rows)


def write_settings_table(path: str | os.PathLike) -> None:
    """Replace the table between :data:`TABLE_START` and :data:`TABLE_END` in ``path`` by :func:`settings_table`."""
    text = Path(path).read_text()
    before, start, rest = text.partition(TABLE_START)
    _, end, after = rest.partition(TABLE_END)
    if not start or not end:
        raise ValueError(f"{path} has no {TABLE_START!r} ... {TABLE_END!r} to write the settings table between")
    Path(path).write_text(f"{before}{TABLE_START}\n{settings_table()}\n{TABLE_END}{after}")
