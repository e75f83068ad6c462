"""Who may change what a shared directory serves: the signing key, file modes, and dead writers.

A directory tier is shared by replicas, restarted engines and other nodes, so anyone who can write
to it can change every reader's embeddings. Three defences, each cheap:

* **Signatures.** With a key (:data:`KEY_ENV`, or the key-file setting), every file carries an
  HMAC-SHA256 of its whole content (every header field and every data byte) under the key, and a
  reader refuses a file without a valid one. The key never travels as a flag value (``ps`` shows
  those). Without a key, a directory that others can write to is warned about once.
* **Modes.** Directories and files are created without group or other write permission (the
  umask may narrow that further), unless a shared group is configured: then they belong to that
  group, directories ``2770`` and files ``0660``.
* **Dead writers.** Temporary and claim files are named (temporaries) or filled (claims) with the
  writer's host and process, so the next process on the same host removes those of a process that
  no longer exists at once instead of after an age, which a clock jump or skew would distort.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_omni_prompt_cache.errors import PromptEmbedCacheConfigError

#: The environment variable that holds the signing key itself (its text, at least :data:`MIN_KEY_BYTES` bytes).
KEY_ENV = "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_DIR_KEY"
MIN_KEY_BYTES = 16
#: The metadata field of a file that holds its signature (hex HMAC-SHA256).
SIGNATURE_FIELD = "signature"
#: Modes of what this package creates: without a shared group, and with one.
PRIVATE_DIRECTORY_MODE, PRIVATE_FILE_MODE = 0o755, 0o644
GROUP_DIRECTORY_MODE, GROUP_FILE_MODE = 0o2770, 0o660


def read_key(key_file: str | None, source: str, environ: Mapping[str, str] | None = None) -> bytes | None:
    """Return the signing key: :data:`KEY_ENV`'s value or the content of ``key_file`` (from ``source``),
    stripped of surrounding whitespace; None when neither is set. Raise a config error for both at
    once, a key shorter than :data:`MIN_KEY_BYTES`, or a key file that others may read or write."""
    environ = os.environ if environ is None else environ
    from_env = environ.get(KEY_ENV)
    if from_env is not None and key_file is not None:
        raise PromptEmbedCacheConfigError(
            f"two signing keys: environment variable {KEY_ENV} and prompt_embed_cache_dir_key_file from {source}; "
            "give one"
        )
    if from_env is not None:
        key, origin = from_env.strip().encode(), f"environment variable {KEY_ENV}"
    elif key_file is not None:
        origin = f"prompt_embed_cache_dir_key_file={key_file!r} from {source}"
        try:
            with open(key_file, "rb") as file:
                mode = os.fstat(file.fileno()).st_mode
                key = file.read().strip()
        except OSError as error:
            raise PromptEmbedCacheConfigError(f"invalid {origin}: cannot read it ({error.strerror})") from None
        if not stat.S_ISREG(mode):
            raise PromptEmbedCacheConfigError(f"invalid {origin}: expected a regular file")
        if mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
            raise PromptEmbedCacheConfigError(
                f"invalid {origin}: the key file is {stat.filemode(mode)}; expected no access for others and no "
                "group write (chmod 600 or 640)"
            )
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise PromptEmbedCacheConfigError(
            f"invalid {origin}: the key has {len(key)} bytes; expected at least {MIN_KEY_BYTES} "
            "(for example the output of `openssl rand -hex 32`)"
        )
    return key


def key_id(key: bytes | None) -> str | None:
    """Return a name of ``key`` that says nothing of it (to check that two processes hold the same one)."""
    return None if key is None else hmac.new(key, b"vllm-omni-prompt-cache key id", hashlib.sha256).hexdigest()[:16]


def header_of(data: bytes) -> tuple[int, dict]:
    """Return a safetensors file's header length and header; raise ValueError for a damaged one."""
    if len(data) < 8:
        raise ValueError("truncated header")
    length = int.from_bytes(data[:8], "little")
    if length <= 0 or 8 + length > len(data):
        raise ValueError("truncated header")

    def no_duplicates(pairs: list) -> dict:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):  # two readers of one header must never see two files
            raise ValueError("a header with a repeated field")
        return dict(pairs)

    header = json.loads(data[8 : 8 + length], object_pairs_hook=no_duplicates)
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise ValueError("no metadata")
    return length, header


def _mac(key: bytes, header: dict, body: memoryview) -> str:
    """HMAC-SHA256 of a header (canonical JSON, without the signature) and the data bytes after it."""
    unsigned = {**header, "__metadata__": {k: v for k, v in header["__metadata__"].items() if k != SIGNATURE_FIELD}}
    mac = hmac.new(key, json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256)
    mac.update(b"\0")
    mac.update(body)
    return mac.hexdigest()


def sign(data: bytes, key: bytes) -> bytes:
    """Return a safetensors file's bytes with its signature added to the header's metadata."""
    length, header = header_of(data)
    body = memoryview(data)[8 + length :]
    header["__metadata__"][SIGNATURE_FIELD] = _mac(key, header, body)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors keeps the data 8-byte aligned
    return len(text).to_bytes(8, "little") + text + body.tobytes()


def signature_valid(data: bytes, key: bytes) -> bool | None:
    """Return True when ``data`` carries a valid signature under ``key``, False for a wrong one, None for
    none; raise ValueError for a header that cannot be read."""
    length, header = header_of(data)
    signature = header["__metadata__"].get(SIGNATURE_FIELD)
    if not isinstance(signature, str):
        return None
    if not signature.isascii():
        return False
    return hmac.compare_digest(signature, _mac(key, header, memoryview(data)[8 + length :]))


@dataclass(frozen=True)
class Modes:
    """How this package creates directories and files under a root: private, or for a shared group."""

    group: int | None = None  # the gid they belong to (None: the creator's)

    @property
    def directory(self) -> int:
        return PRIVATE_DIRECTORY_MODE if self.group is None else GROUP_DIRECTORY_MODE

    @property
    def file(self) -> int:
        return PRIVATE_FILE_MODE if self.group is None else GROUP_FILE_MODE

    def make_directory(self, path: Path) -> bool:
        """Create ``path`` (and missing parents with the same mode); return whether it was created."""
        if path.is_dir():
            return False
        if not path.parent.is_dir():
            self.make_directory(path.parent)
        try:
            os.mkdir(path, self.directory)
        except FileExistsError:
            return False
        if self.group is not None:  # through a descriptor: a link swapped in meanwhile is not followed
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                self._own(fd, self.directory)
            finally:
                os.close(fd)
        return True

    def create(self, path: Path, flags: int = 0) -> int:
        """Open a new file at ``path`` for writing (never through a link; it must not exist); return its fd."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | flags, self.file)
        try:
            self._own(fd, self.file)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _own(self, fd: int, mode: int) -> None:
        if self.group is None:
            return  # the umask applies, and can only narrow the mode
        os.fchown(fd, -1, self.group)
        os.fchmod(fd, mode)  # past the umask: the group asked for write


#: What a tier uses without a shared group.
PRIVATE = Modes()


def writable_by_others(path: Path, *, status: os.stat_result | None = None) -> str | None:
    """Return how someone besides this process's user can write to ``path`` (None: nobody can)."""
    try:
        status = status or os.stat(path)
    except OSError:
        return None
    if status.st_mode & stat.S_IWOTH:
        return f"{path} is writable by everyone ({stat.filemode(status.st_mode)})"
    if status.st_mode & stat.S_IWGRP:
        return f"{path} is writable by group {status.st_gid} ({stat.filemode(status.st_mode)})"
    if status.st_uid != os.geteuid():
        return f"{path} belongs to user {status.st_uid}"
    return None


@functools.cache
def host_id() -> str:
    """Return 8 hex digits naming this host and process-id namespace: pids mean something only there."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        parts.append("?")
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))  # containers on one host: other pid spaces
    except OSError:
        parts.append("?")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def owner_tag() -> str:
    """Return what names this process as the owner of a temporary or claim file: ``<host id>-<pid>``."""
    return f"{host_id()}-{os.getpid()}"


def owner_gone(tag: str) -> bool:
    """Return True when ``tag`` (:func:`owner_tag`, perhaps followed by a space and more) names a process
    of this host that no longer exists. A reused pid reads as alive: the caller falls back to age."""
    host, _, pid = tag.split(" ", 1)[0].partition("-")
    if host != host_id() or not pid.isdecimal():
        return False  # another host's (or an older format's): only its age can tell
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, as another user's process
        return False
    return False
