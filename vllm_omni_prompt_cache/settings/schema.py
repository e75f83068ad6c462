"""How the cache's settings resolve: keyword arguments, serve flags, environment variables.

Every setting has one name for each way to give it (see :data:`SETTINGS`) and
one precedence rule, upstream's: **an environment variable overrides the
keyword argument or flag, which overrides the default.** A bad value from any
source raises :class:`PromptEmbedCacheConfigError` naming the setting, where the
value came from and what is allowed; nothing is silently ignored.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni_prompt_cache.errors import PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.settings import values
from vllm_omni_prompt_cache.store.tiers.directory_trust import KEY_ENV, MIN_KEY_BYTES
from vllm_omni_prompt_cache.store.tiers.host import HOST_AT_SLEEP


@dataclass(frozen=True)
class Setting:
    """One setting: its names as a keyword argument, a serve flag and an env var, its parser, and how --help
    and the docs table show it. Everything a setting is made into (the kwargs, flags and env vars read, the
    settings object's attribute, ``install_prompt_embed_cache``'s use of it, the docs table) is read from here.

    A setting without an env var (``env=None``) is given in code only: a function or an object that cannot
    travel to another process (a digest function); it has no flag and no kwarg.
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
        return None if parsed is values.NO_LIMIT or parsed is values.OFF else parsed

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
    values.boolean,
)
MAX_SIZE = Setting(
    "prompt_embed_cache_size",
    "max_size",
    "--prompt-embed-cache-size",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_SIZE",
    32,
    "an integer >= 1 (number of cached encode_prompt results)",
    "Most encode_prompt results kept (LRU).",
    values.positive_int,
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
    values.byte_budget,
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
    values.boolean,
)
BACKEND = Setting(
    "prompt_embed_cache_backend",
    "backend",
    "--prompt-embed-cache-backend",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_BACKEND",
    "content-keyed",
    f"one of {', '.join(values.BACKENDS)}",
    "Which cache to install: this package's content-keyed one, or vLLM-Omni's own (to compare them).",
    values.backend,
    metavar="{" + ",".join(values.BACKENDS) + "}",
)

METHODS = Setting(
    "prompt_embed_cache_methods",
    "methods",
    "--prompt-embed-cache-methods",
    "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_METHODS",
    {},
    "CLASS=METHOD[+METHOD...] pairs separated by commas: CLASS a pipeline class path (pkg.module.Class), "
    "METHOD the name of a method of it that encodes prompts; each class once",
    "Encode methods to count besides encode_prompt, for pipeline classes you cannot edit (each counted on its "
    "own; one that reaches no text encoder the cache recognises is cached whole on its arguments).",
    values.methods,
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
    "Count a text-encoder call made outside every wrapped method under the pipeline method that made it, "
    "whatever it is called (its encoder calls are cached either way). Off: counted under the encoder's name.",
    values.boolean,
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
    values.host_budget,
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
    values.directory,
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
    values.byte_budget,
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
    values.key_file,
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
    values.group,
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
    values.boolean,
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
    values.fraction,
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
    values.function,
)
REPORT = Setting(
    "report",
    "report",
    None,
    None,
    None,
    "a function of the cache",
    "Runs after each call with the cache (the vLLM-Omni worker's rate-limited statistics log line).",
    values.function,
)
DIRECTORY_KEY = Setting(
    "directory_key",
    "directory_key",
    None,
    None,
    None,
    f"bytes, {MIN_KEY_BYTES} or more",
    f"The directory tier's signing key itself (a worker reads it from {DIRECTORY_KEY_FILE.name} or {KEY_ENV}).",
    values.key_bytes,
)

#: Settings of earlier releases that no longer exist, by the names a user gave them, with what replaces them:
#: given (a keyword argument or an environment variable), they raise rather than being ignored.
REMOVED: Mapping[str, str] = {
    name: "removed in 0.3.0: a batched call's rows are cut where they reach the text encoder, whatever the "
    "pipeline, and shown independent on first use; nothing replaces the setting"
    for name in (
        "prompt_embed_cache_row_layouts",
        "row_layouts",
        "row_layout",
        "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_ROW_LAYOUTS",
    )
}

#: Every setting, in the order --help and the docs table show them.
SETTINGS: tuple[Setting, ...] = (
    ENABLE,
    MAX_SIZE,
    MAX_BYTES,
    VERIFY,
    BACKEND,
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
    DIRECTORY_KEY,
)


def carried_settings() -> tuple[Setting, ...]:
    """Return the settings users give (kwargs, flags, env vars): those that travel to the worker."""
    return tuple(setting for setting in SETTINGS if setting.carried)


def by_field() -> dict[str, Setting]:
    return {setting.field: setting for setting in SETTINGS}


TABLE_START = "<!-- settings table: made from settings.schema.SETTINGS by `make docs-table`; edit there -->"
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
