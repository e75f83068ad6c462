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
again to resume. Only one pack runs at a time per namespace (an ``O_EXCL`` lock file). A shard
whose bytes differ from the index (damaged, truncated, rewritten by hand) serves nothing: the
first read that finds it says so, naming the file, and every entry of it is a miss from then on.
Shards are never evicted by the directory's byte budget and never removed on a bad read: they are
read-only data a job prepared, often on storage the readers cannot write.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

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
_SHARD_NAME = re.compile(r"^shard-(\d{5,})\.pack$")
_ENTRY_NAME = re.compile(r"^[0-9a-f]{40}\.safetensors$")


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
    Raise :class:`ShardError` naming the index when it is not one this namespace wrote."""
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
        return {name: Located(*where) for name, where in index["entries"].items()}
    except ShardError:
        raise
    except Exception as error:
        raise ShardError(f"{path}: not a shard index ({type(error).__qualname__}: {error})") from None


class Shards:
    """The packed entries of one namespace directory, read in place; thread-safe.

    The index is read on first use and again when its file changes (a pack ran meanwhile; looked at
    no more than every :data:`INDEX_CHECK_S` seconds). Each shard is opened once and kept open, so
    a read is one ``pread``: no metadata operation per entry.
    """

    def __init__(self, directory: Path, namespace: str) -> None:
        self.directory = directory / SHARDS
        self.namespace = namespace
        self._lock = threading.Lock()
        self._index: dict[str, Located] = {}
        self._index_stamp: tuple[int, int] | None = None
        self._index_checked = -INDEX_CHECK_S  # monotonic time of the last look at the index file
        self._open: dict[str, int] = {}  # shard file name -> its open descriptor
        #: Descriptors of shards an older index named: a read may still be using one, so they stay open
        #: until :meth:`close` (a closed number could be reused by another file under that read).
        self._retired: list[int] = []
        self._damaged: dict[str, str] = {}  # shard file name -> why it serves nothing

    def __len__(self) -> int:
        return len(self._current_index())

    def read(self, name: str) -> bytes | None:
        """Return the bytes of entry file ``name`` from its shard, or None when no shard holds it (or its shard is
        damaged). Raise :class:`ShardError`, naming the shard, the first time a read finds a shard damaged."""
        located = self._current_index().get(name)
        if located is None or located.shard in self._damaged:
            return None
        try:
            data = os.pread(self._descriptor(located.shard), located.length, located.offset)
        except OSError as error:
            raise self.damaged(located.shard, f"cannot be read ({error.strerror})") from None
        if len(data) != located.length:
            raise self.damaged(
                located.shard,
                f"truncated: {located.offset + len(data)} bytes where the index "
                f"needs {located.offset + located.length}",
            )
        if _digest(data) != located.digest:
            raise self.damaged(located.shard, f"the bytes of entry {name} differ from the index's digest")
        return data

    def _descriptor(self, shard: str) -> int:
        with self._lock:
            fd = self._open.get(shard)
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

    def reject(self, name: str, why: str) -> None:
        """Entry ``name`` read whole but failed a file's checks (``why``): its shard serves nothing more."""
        located = self._current_index().get(name)
        if located is not None:
            self.damaged(located.shard, f"entry {name}: {why}")

    def damaged(self, shard: str, why: str) -> ShardError:
        """Mark ``shard`` as serving nothing from now on; return the error that says so (logged once)."""
        with self._lock:
            first = shard not in self._damaged
            self._damaged.setdefault(shard, why)
        error = ShardError(f"shard {self.directory / shard} is damaged ({why}): nothing is served from it")
        if first:
            logger.error("Prompt-embed cache: %s; its entries are encoded again.", error)
        return error

    def _current_index(self) -> dict[str, Located]:
        now = time.monotonic()
        with self._lock:
            if now - self._index_checked < INDEX_CHECK_S:
                return self._index
            self._index_checked = now
        try:
            status = os.stat(self.directory / INDEX)
            stamp = (status.st_mtime_ns, status.st_size, status.st_ino)
        except OSError:
            stamp = None
        with self._lock:
            if stamp != self._index_stamp:
                try:
                    self._index = read_index(self.directory, self.namespace) if stamp is not None else {}
                except ShardError as error:
                    logger.error("Prompt-embed cache: %s; no shard of it is used.", error)
                    self._index = {}
                self._index_stamp = stamp
                self._damaged.clear()  # a new pack: shards are judged again
                self._retired.extend(self._open.values())
                self._open = {}
            return self._index


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
    shards.mkdir(exist_ok=True)
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
    packed = [path for path in pending if path.name in index]  # packed before; removal was interrupted
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
        if path.name in index:
            continue
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # the directory's budget (or another process) removed it meanwhile
            continue
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


def _write_durably(path: Path, parts: Iterable[bytes]) -> None:
    """Write ``parts`` to a temporary file beside ``path``, flush it to disk, rename it over ``path``."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "wb") as file:
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
        names = list(read_index(shards.directory, namespace))
    except ShardError as error:
        return [str(error)]
    for name in names:
        try:
            shards.read(name)
        except ShardError as error:
            if str(error) not in problems:
                problems.append(str(error))
    return problems
