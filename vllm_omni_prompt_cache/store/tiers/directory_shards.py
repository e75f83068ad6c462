"""Packed entries: many of the directory tier's entry files in one shard, found through an index.

A dataset of 10,000 prompts is 10,000 small files in the directory tier; on a shared filesystem
(CephFS, Lustre, NFS) each costs a metadata round trip to create, list and open. ``precompute
--pack`` moves a namespace's entry files into a few large shards that readers use in place:

    <root>/<namespace>/shards/index.json
    <root>/<namespace>/shards/shard-00000.pack, shard-00001.pack, ...

A shard holds the entry files' bytes back to back, exactly as they were written (signed where the
directory is signed). The index names, for each entry's file name, its shard, offset, length and an
xxh3-128 digest of those bytes. A read takes one range of one shard (no per-entry file) and hands
it to the directory tier, which decodes it as it decodes a file: format, namespace, key identity,
checksum, key bytes and signature are all checked again.

Writes never leave a reader half a shard or an index naming bytes that are not there: a shard is
written under a temporary name, flushed to disk and renamed, then the index the same way, and only
then are the packed entry files removed. An interrupted pack leaves the old index and the entry
files as they were (plus, at worst, a shard no index names, which the next pack removes): run it
again to resume. A file written again since its entry was packed (its shard damaged, another
signing key) is packed anew and the index names its new bytes. Only one pack runs at a time per
namespace (an ``O_EXCL`` lock file); it reads no link or non-regular file, and creates what it
writes without group or other write. A shard whose bytes differ from the index (damaged,
truncated, rewritten by hand) serves nothing: the first read that finds it says so, naming the
file, and every entry of it is a miss from then on. An entry whose bytes match the index but fail
a file's checks (another namespace or signing key) is refused alone, said once.
Shards are never evicted by the directory's byte budget and never removed on a bad read: they are
read-only data a job prepared, often on storage the readers cannot write.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

logger = logging.getLogger(__name__)

FORMAT = "vllm-omni-prompt-cache-shards/1"
SHARDS = "shards"
INDEX = "index.json"
LOCK = "pack.lock"
#: The default most bytes a shard holds (a shard may hold one entry larger than that).
SHARD_BYTES = 2**30
#: Seconds between two looks at the index file: a pack another process ran is seen within this.
INDEX_CHECK_S = 1.0
#: The largest entry an index may name (a range no entry file of the directory tier comes near).
MAX_ENTRY_BYTES = 2**31
_SHARD_NAME = re.compile(r"^shard-(\d{5,})\.pack$")
_ENTRY_NAME = re.compile(r"^[0-9a-f]{40}\.safetensors$")
_DIGEST = re.compile(r"^[0-9a-f]{32}$")


class ShardError(Exception):
    """A shard or index that must not be used; the message names the file and why."""


@dataclass(frozen=True)
class Located:
    """Where an entry's bytes are: ``length`` bytes at ``offset`` of ``shard``, whose xxh3-128 is ``digest``."""

    shard: str
    offset: int
    length: int
    digest: str


def _digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def read_index(directory: Path, namespace: str) -> dict[str, Located]:
    """Return ``directory``'s index (entry file name -> where its bytes are); {} when there is none.
    Raise :class:`ShardError` naming the index when it is not one this namespace wrote, or names
    something other than an entry of a shard beside it."""
    path = directory / INDEX
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        index = json.loads(text)
        if index.get("format") != FORMAT:
            raise ShardError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}")
        if index.get("namespace") != namespace:
            raise ShardError(f"{path}: written for namespace {index.get('namespace')!r}, not {namespace!r}")
        return {name: _located(path, name, where) for name, where in index["entries"].items()}
    except ShardError:
        raise
    except Exception as error:
        raise ShardError(f"{path}: not a shard index ({type(error).__qualname__}: {error})") from None


def _located(path: Path, name: str, where: Any) -> Located:
    """One index entry, checked: an entry file's name, a shard beside the index, a range, a digest."""
    shard, offset, length, digest = where if isinstance(where, list) and len(where) == 4 else (None,) * 4
    if not (
        _ENTRY_NAME.match(name)
        and isinstance(shard, str)
        and _SHARD_NAME.match(shard)
        and type(offset) is int
        and type(length) is int
        and offset >= 0
        and 0 < length <= MAX_ENTRY_BYTES
        and isinstance(digest, str)
        and _DIGEST.match(digest)
    ):
        raise ShardError(f"{path}: entry {name!r} -> {where!r} is not an entry of a shard beside the index")
    return Located(shard, offset, length, digest)


class Shards:
    """The packed entries of one namespace directory, read in place; thread-safe.

    The index is read on first use and again when its file changes (a pack ran meanwhile; looked at
    no more than every :data:`INDEX_CHECK_S` seconds, or at once when asked ``fresh``). Each shard is
    opened once and kept open, so a read is one ``pread``: no metadata operation per entry. A pack
    never rewrites a shard the index names (new entries go to new shards), so descriptors outlive a
    new index; one whose shard left the index stays open until :meth:`close`, since a read may hold it.
    """

    def __init__(self, directory: Path, namespace: str) -> None:
        self.directory = directory / SHARDS
        self.namespace = namespace
        self._lock = threading.Lock()
        self._reload_lock = threading.Lock()  # one thread reads a new index, outside the readers' lock
        self._index: dict[str, Located] = {}
        self._index_stamp: tuple[int, int, int] | None = None
        self._index_checked = -INDEX_CHECK_S  # monotonic time of the last look at the index file
        self._open: dict[str, int] = {}  # shard file name -> its open descriptor
        self._retired: list[int] = []  # descriptors of shards no index names any more
        self._damaged: dict[str, str] = {}  # shard file name -> why it serves nothing
        self._refused: dict[str, str] = {}  # entry file name -> why its bytes failed a file's checks

    def read(self, name: str, *, fresh: bool = False) -> bytes | None:
        """Return the bytes of entry file ``name`` from its shard, or None when no shard holds it (or it was
        refused, or its shard is damaged). ``fresh``: look at the index file now (a pack may just have moved
        the entry). Raise :class:`ShardError`, naming the shard, the first time a read finds it damaged."""
        located = self._current_index(fresh=fresh).get(name)
        if located is None or located.shard in self._damaged or name in self._refused:
            return None
        data = b""
        for attempt in range(2):  # a passing error (a stale handle, too many open files) is tried once more
            try:
                data = os.pread(self._descriptor(located.shard, reopen=attempt > 0), located.length, located.offset)
                break
            except OSError as error:
                if attempt or error.errno in (errno.ENOENT, errno.EACCES, errno.ELOOP):
                    raise self.damaged(located.shard, f"cannot be read ({error.strerror})") from None
        if len(data) != located.length:
            raise self.damaged(
                located.shard,
                f"truncated: {located.offset + len(data)} bytes where the index needs "
                f"{located.offset + located.length}",
            )
        if _digest(data) != located.digest:
            raise self.damaged(located.shard, f"the bytes of entry {name} differ from the index's digest")
        return data

    def _descriptor(self, shard: str, *, reopen: bool = False) -> int:
        with self._lock:
            fd = self._open.get(shard)
            if fd is not None and reopen:
                self._retired.append(self._open.pop(shard))
                fd = None
            if fd is None:
                fd = self._open[shard] = os.open(self.directory / shard, os.O_RDONLY | os.O_NOFOLLOW)
            return fd

    def close(self) -> None:
        """Close every shard this reader holds open; only when no read is under way (at the end of its life)."""
        with self._lock:
            for fd in [*self._open.values(), *self._retired]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._open.clear()
            self._retired.clear()

    def __del__(self) -> None:
        self.close()

    def refuse(self, name: str, why: str) -> None:
        """Entry ``name`` matched the index but failed a file's checks (``why``): that entry is never served
        from its shard again (the rest of the shard still is). Said once, naming the shard."""
        located = self._index.get(name)
        with self._lock:
            first = name not in self._refused
            self._refused[name] = why
        if first:
            where = self.directory / located.shard if located is not None else self.directory
            logger.error(
                "Prompt-embed cache: entry %s of shard %s refused (%s); it is encoded again.", name, where, why
            )

    def damaged(self, shard: str, why: str) -> ShardError:
        """Mark ``shard`` as serving nothing from now on; return the error that says so (logged once)."""
        with self._lock:
            first = shard not in self._damaged
            self._damaged.setdefault(shard, why)
        error = ShardError(f"shard {self.directory / shard} is damaged ({why}): nothing is served from it")
        if first:
            logger.error("Prompt-embed cache: %s; its entries are encoded again.", error)
        return error

    def _current_index(self, *, fresh: bool = False) -> dict[str, Located]:
        now = time.monotonic()
        with self._lock:
            if not fresh and now - self._index_checked < INDEX_CHECK_S:
                return self._index
        with self._reload_lock:  # one thread at a time looks (readers of the index in hand are not held up)
            with self._lock:
                if not fresh and time.monotonic() - self._index_checked < INDEX_CHECK_S:
                    return self._index  # another thread looked while this one waited
                self._index_checked = now
            try:
                status = os.stat(self.directory / INDEX)
                stamp = (status.st_mtime_ns, status.st_size, status.st_ino)
            except OSError:
                stamp = None
            if stamp == self._index_stamp:
                return self._index
            try:
                index = read_index(self.directory, self.namespace) if stamp is not None else {}
            except ShardError as error:
                logger.error("Prompt-embed cache: %s; no shard of it is used.", error)
                index = {}
            named = {located.shard for located in index.values()}
            with self._lock:
                self._index, self._index_stamp = index, stamp
                self._damaged = {shard: why for shard, why in self._damaged.items() if shard in named}
                self._refused = {name: why for name, why in self._refused.items() if name in index}
                for shard in [shard for shard in self._open if shard not in named]:
                    self._retired.append(self._open.pop(shard))
            return index


@dataclass(frozen=True)
class PackReport:
    """What one pack did."""

    packed: int  # entry files moved into shards
    shards_written: int
    files_removed: int  # packed entry files removed
    unindexed_removed: int  # shards of an interrupted pack, removed
    entries: int  # entries the index names now
    shards: int  # shard files the index names now


def pack(namespace_directory: str | os.PathLike, namespace: str, *, shard_bytes: int = SHARD_BYTES) -> PackReport:
    """Move the entry files of ``namespace_directory`` into shards (see the module); return what was done.

    Raise :class:`ShardError` when another pack holds the namespace's lock, or the index is not this
    namespace's; OSError when the storage refuses a write (nothing is removed then).
    """
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be an integer >= 1, got {shard_bytes!r}")
    directory = Path(namespace_directory)
    shards = directory / SHARDS
    shards.mkdir(mode=0o755, exist_ok=True)  # never group- or other-writable, whatever the umask
    lock = shards / LOCK
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        raise ShardError(
            f"{lock} exists: another pack of this namespace is running (or one crashed: remove the file if none runs)"
        ) from None
    try:
        return _pack_locked(directory, shards, namespace, shard_bytes)
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()


def _pack_locked(directory: Path, shards: Path, namespace: str, shard_bytes: int) -> PackReport:
    index = read_index(shards, namespace)
    named = {located.shard for located in index.values()}
    unindexed = [path for path in shards.iterdir() if _SHARD_NAME.match(path.name) and path.name not in named]
    unindexed += [path for path in shards.iterdir() if path.name.startswith(".") and path.name.endswith(".tmp")]
    for path in unindexed:  # an interrupted pack's: no index names them
        path.unlink(missing_ok=True)
    pending = sorted(path for path in directory.iterdir() if _ENTRY_NAME.match(path.name))
    packed: list[Path] = []  # entry files whose bytes the index will name: removed once it is on disk
    numbers = [int(_SHARD_NAME.match(name)[1]) for name in named]
    next_number = max(numbers, default=-1) + 1
    written = newly = 0
    batch: list[tuple[str, bytes]] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal next_number, written, batch, batch_bytes
        if not batch:
            return
        name = f"shard-{next_number:05d}.pack"
        offset = 0
        for entry_name, data in batch:
            index[entry_name] = Located(name, offset, len(data), _digest(data))
            offset += len(data)
        _write_durably(shards / name, (data for _, data in batch))
        next_number, written, batch, batch_bytes = next_number + 1, written + 1, [], 0

    for path in pending:
        data = _entry_file(path)
        if data is None:  # gone meanwhile (the directory's budget, another process), or not a regular file
            continue
        if path.name in index and _digest(data) == index[path.name].digest:
            packed.append(path)  # packed before, its removal interrupted: the same bytes
            continue
        # New, or written again since it was packed (its shard damaged, another signing key): packed anew, and
        # the index names the new bytes.
        if batch and batch_bytes + len(data) > shard_bytes:
            flush()
        batch.append((path.name, data))
        batch_bytes += len(data)
        packed.append(path)
        newly += 1
    flush()
    if written:
        entries = {name: [where.shard, where.offset, where.length, where.digest] for name, where in index.items()}
        text = json.dumps({"format": FORMAT, "namespace": namespace, "entries": entries}, sort_keys=True)
        _write_durably(shards / INDEX, [text.encode()])
    removed = 0
    for path in packed:  # only now: the index that names their bytes is on disk
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return PackReport(
        packed=newly,
        shards_written=written,
        files_removed=removed,
        unindexed_removed=len(unindexed),
        entries=len(index),
        shards=len({where.shard for where in index.values()}),
    )


def _entry_file(path: Path) -> bytes | None:
    """Return an entry file's bytes: never through a link, never from a pipe or device (None then, or when gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_ENTRY_BYTES:
            return None
        return file.read()


def _write_durably(path: Path, parts: Iterable[bytes]) -> None:
    """Write ``parts`` to a temporary file beside ``path``, flush it to disk, rename it over ``path``."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        # 0644, whatever the umask: readers trust what the index names, so only this user writes it.
        with os.fdopen(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644), "wb") as file:
            for part in parts:
                file.write(part)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        with contextlib.suppress(OSError):  # the rename itself, where the filesystem allows it
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def verify(namespace_directory: str | os.PathLike, namespace: str) -> list[str]:
    """Return what is wrong with the namespace's shards (every entry's bytes against the index); [] when none."""
    shards = Shards(Path(namespace_directory), namespace)
    problems: list[str] = []
    try:
        for name in read_index(shards.directory, namespace):
            try:
                shards.read(name)
            except ShardError as error:
                if str(error) not in problems:
                    problems.append(str(error))
    except ShardError as error:
        problems.append(str(error))
    finally:
        shards.close()
    return problems
