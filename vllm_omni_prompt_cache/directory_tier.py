"""Where entries outlive the process: one safetensors file per entry in a directory processes share.

Layout: ``<root>/<namespace>/<name>.safetensors``. The namespace is a digest of what produced the
entries (see :mod:`.fingerprint`): another model, checkpoint, tokenizer or package version writes
and reads another namespace, so it can never read these. ``<name>`` is a digest of the entry's key
identity. A file holds the value's tensors, the key's witness bytes and, in its metadata, the
namespace, the identity, the value's structure and a checksum of every tensor byte and of that
metadata.

Safety, since several replicas, restarted engines and other nodes may use one directory at once:

* safetensors holds tensors and strings only: reading a file cannot run code;
* a file is written to a temporary name in the same directory, then ``os.replace``-d over its
  final name: a reader sees a whole file or none, and two writers of one key both write the same
  bytes, the last rename winning;
* a file that is truncated, corrupt, from another namespace, or whose identity or witness differs
  from the probe is a miss: it is removed and counted by reason, never raised, never returned;
* a write that fails (a full disk, a read-only mount, anything) is counted and abandoned; the
  entry still lives in memory. Nothing here raises into the caller;
* a process that misses an entry claims it (an ``O_EXCL`` claim file beside it, naming the
  process) while it encodes; another process missing the same entry meanwhile waits for the file
  instead of encoding it too, up to :data:`CLAIM_WAIT_S`, so replicas that receive one prompt at
  once encode it once in all. A claim whose process no longer exists is taken over at once;
* with a signing key, a file without a valid signature is refused; a link where a file should be
  is never followed; what this package creates is not writable by group or others unless a shared
  group is configured (see :mod:`.directory_trust`).

The byte budget covers this package's files under the root (every namespace, so stale ones are
the first to go; nothing else under the root is touched): each process counts its own writes and
rescans the root when they would pass the budget, or every :data:`RESCAN_EVERY_WRITES` writes,
removing the least recently used files (a hit refreshes a file's modification time) until
:data:`LOW_WATER` of the budget is used.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch
import xxhash

from vllm_omni_prompt_cache.directory_trust import (
    KEY_ENV,
    PRIVATE,
    Modes,
    header_of,
    owner_gone,
    owner_tag,
    sign,
    signature_valid,
    writable_by_others,
)
from vllm_omni_prompt_cache.keys import witness_matches
from vllm_omni_prompt_cache.logs import warn_once

logger = logging.getLogger(__name__)

FORMAT = "vllm-omni-prompt-cache/1"
SUFFIX = ".safetensors"
CLAIM_SUFFIX = ".claim"
#: Writes between two rescans of the root's size (other processes write too).
RESCAN_EVERY_WRITES = 256
#: A rescan over budget removes files until this share of the budget is used.
LOW_WATER = 0.9
#: A temporary or claim file older than this is a crashed writer's: a rescan removes it (sooner when
#: its process is known to be gone).
STALE_TEMPORARY_S = 3600.0
#: How long a process that misses an entry another process is encoding waits for its file
#: before encoding it too (a claim older than this is a crashed encoder's, and is taken over).
CLAIM_WAIT_S = 10.0

# What this package writes under the root; a rescan touches nothing else.
_NAMESPACE_NAME = re.compile(r"^[0-9a-f]{32}$")
_ENTRY_NAME = re.compile(r"^[0-9a-f]{40}\.safetensors$")
_TEMPORARY_NAME = re.compile(
    r"^\.([0-9a-f]{40}\.safetensors|NAMESPACE\.json)\.(?P<owner>(?:[0-9a-f]{8}-)?\d+)\.[0-9a-f]{8}\.tmp$"
)
_CLAIM_NAME = re.compile(r"^[0-9a-f]{40}\.claim$")

# Reasons a file is removed on read (the ``reason`` label of the rejection counts).
UNREADABLE = "unreadable or truncated"
CHECKSUM = "checksum mismatch"
FOREIGN = "another namespace or format"
IDENTITY = "key identity differs"
WITNESS = "key bytes differ"
UNSIGNED = "unsigned"
SIGNATURE = "signature mismatch"
NOT_A_FILE = "a link or not a regular file"
TOO_LARGE = "larger than the directory's budget"

#: dtypes a file can hold (what safetensors stores).
_STORABLE_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)
#: Metadata fields the checksum covers (with every tensor byte).
_CHECKED_METADATA = ("format", "namespace", "identity", "structure", "devices", "tensors", "witness")


class Unstorable(Exception):
    """A value a file cannot hold exactly (an object that is not a tensor, plain scalar or container)."""


def identity_name(identity: Hashable) -> str:
    """Return the file name stem of a key identity: a digest of its repr (stable across processes)."""
    return hashlib.sha256(repr(identity).encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _structure(value: Any, tensors: list[torch.Tensor]) -> Any:
    """Return ``value``'s structure as JSON, appending its tensors to ``tensors``."""
    kind = type(value)
    if isinstance(value, torch.Tensor):
        if value.dtype not in _STORABLE_DTYPES or value.layout is not torch.strided or value.is_nested:
            raise Unstorable(f"a {value.dtype} {value.layout} tensor")
        tensors.append(value)
        return {"tensor": len(tensors) - 1}
    if value is None:
        return None
    if kind is bool:
        return {"bool": value}
    if kind is int:
        return {"int": value}
    if kind is float:
        return {"float": value.hex()}
    if kind is str:
        return {"str": value}
    if kind in (tuple, list):
        return {kind.__name__: [_structure(item, tensors) for item in value]}
    if kind is dict:
        return {"dict": [[_structure(key, tensors), _structure(item, tensors)] for key, item in value.items()]}
    raise Unstorable(f"a {kind.__module__}.{kind.__qualname__}")


def _rebuild(structure: Any, tensors: list[torch.Tensor]) -> Any:
    if structure is None:
        return None
    (kind, content), *_ = structure.items()
    if kind == "tensor":
        return tensors[content]
    if kind in ("bool", "int", "str"):
        return content
    if kind == "float":
        return float.fromhex(content)
    if kind == "tuple":
        return tuple(_rebuild(item, tensors) for item in content)
    if kind == "list":
        return [_rebuild(item, tensors) for item in content]
    if kind == "dict":
        return {_rebuild(key, tensors): _rebuild(item, tensors) for key, item in content}
    raise ValueError(f"unknown structure kind {kind!r}")


def _checksum(tensors: list[torch.Tensor], metadata: dict[str, str]) -> str:
    hasher = xxhash.xxh3_128()
    for name in _CHECKED_METADATA:
        hasher.update(f"{name}={metadata[name]}\0".encode("utf-8", "surrogatepass"))
    for tensor in tensors:
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def _read_metadata(data: bytes) -> dict[str, str]:
    return header_of(data)[1]["__metadata__"]


def _witness_tensor(part: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(part), dtype=torch.uint8) if part else torch.empty(0, dtype=torch.uint8)


class DirectoryTier:
    """Entries as files under ``root``, within ``max_bytes`` (None: no limit).

    ``fingerprint()`` returns a JSON-able description of what produces this process's entries, or a
    string saying why there is none (then the tier is unused until :meth:`invalidate`). It runs
    on first use and again after each :meth:`invalidate` (new weights); :attr:`epoch` counts the
    invalidations, so a result computed before one is never written under the namespace after it.
    ``local_device(recorded)`` maps the device a file's tensor was encoded on to this process's.
    ``key``: the signing key (None: files are neither signed nor required to be); ``modes``: how
    directories and files are created (see :mod:`.directory_trust`).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        max_bytes: int | None,
        fingerprint: Callable[[], dict[str, Any] | str],
        *,
        local_device: Callable[[str], torch.device | str] = torch.device,
        key: bytes | None = None,
        modes: Modes = PRIVATE,
    ) -> None:
        self.root = Path(root)
        self._key = key
        self.modes = modes
        self.max_bytes = max_bytes
        self._fingerprint = fingerprint
        self._local_device = local_device
        self._lock = threading.Lock()
        self.epoch = 0  # bumped by invalidate()
        self._namespace: str | None = None
        self._description = ""  # what produced the namespace's entries (its NAMESPACE.json)
        self._off_reason: str | None = None  # set by disable(): for the rest of this tier's life
        self._unavailable: str | None = None  # the fingerprint's reason, until invalidate()
        self._suspended = 0  # suspend() calls not yet resumed: weights are changing
        self._scanned_bytes: int | None = None  # this package's files under root at the last rescan
        self._written_since_scan = 0
        self._writes_since_scan = 0
        # Entries this process is encoding, by (epoch of the encode, identity), to their claim files and
        # what this process wrote in them (a claim taken over by another process is not this one's).
        self._claims: dict[tuple[int, Hashable], tuple[Path, str]] = {}
        self._scanned_once = False  # the first use removes crashed processes' leftovers, in the background
        self.first_scan = threading.Event()
        self.claim_wait_s = CLAIM_WAIT_S
        # Counts since the tier was made, read by the store's snapshot.
        self.hits = 0
        self.misses = 0
        self.waits = 0  # hits that waited for another process's encode of the same entry
        self.writes = 0
        self.write_errors = 0  # writes that failed or were refused (too large for the budget)
        self.evictions = 0  # files removed to stay within max_bytes
        self.rejections: Counter[str] = Counter()  # files removed on read, by reason
        self.files = 0  # this package's files under root at the last rescan
        self.stale_claims = 0  # claims of a process that is gone (or of one silent for claim_wait_s), taken over
        self.wait_timeouts = 0  # waits for another process's encode that ended without its file
        self.leftovers_removed = 0  # temporary and claim files of crashed processes removed

    @property
    def bytes(self) -> int:
        """Return the bytes of files under the root: the last rescan plus this process's writes since."""
        return (self._scanned_bytes or 0) + self._written_since_scan

    @property
    def namespace(self) -> str | None:
        """Return this process's namespace (a hex digest), computing it if needed; None when unusable."""
        return self._namespace_at(None)

    def _namespace_at(self, epoch: int | None) -> str | None:
        """Return the namespace, or None when unusable or when ``epoch`` is not the current one."""
        with self._lock:
            if self._off_reason is not None or self._unavailable is not None or self._suspended:
                return None
            if epoch is not None and epoch != self.epoch:
                return None  # the weights changed since the caller's encode began
            if self._namespace is None:
                try:
                    described = self._fingerprint()
                    text = described if isinstance(described, str) else json.dumps(described, sort_keys=True)
                except Exception as error:  # an encoder or tokenizer we cannot read: no directory, no error
                    described = text = f"the fingerprint failed ({type(error).__qualname__}: {error})"
                if isinstance(described, str):
                    self._unavailable = described
                    logger.warning("Prompt-embed cache: directory tier unused: %s.", described)
                    return None
                self._namespace = hashlib.sha256(text.encode()).hexdigest()[:32]
                self._describe(self._namespace, text)
            return self._namespace

    def _describe(self, namespace: str, description: str) -> None:
        """Write ``NAMESPACE.json`` (what produced the namespace's files), for people; lock held."""
        self._description = description
        directory = self.root / namespace
        try:
            self.modes.make_directory(directory)
            target = directory / "NAMESPACE.json"
            if not target.exists():
                self._write_atomically(target, description.encode())
        except OSError as error:
            warn_once(f"cannot write to the directory tier {directory} ({error})")
        if self._key is None:
            for path in (self.root, directory):
                if (how := writable_by_others(path)) is not None:
                    self._warn_untrusted(how)
                    break

    def _warn_untrusted(self, how: str) -> None:
        warn_once(
            f"the directory tier is not signed and others can write to it ({how}): whoever can write there "
            f"can change the embeddings this process serves; set a signing key ({KEY_ENV} or "
            "prompt_embed_cache_dir_key_file) or keep the directory to this user"
        )

    def invalidate(self) -> None:
        """Forget the namespace: what produces entries changed (new text-encoder weights)."""
        with self._lock:
            self.epoch += 1
            self._namespace = None
            self._unavailable = None

    def suspend(self) -> None:
        """Neither read nor write until :meth:`resume`: text-encoder weights are changing, and what is
        encoded meanwhile belongs to no namespace."""
        with self._lock:
            self._suspended += 1
            self.epoch += 1

    def resume(self) -> None:
        """End a :meth:`suspend`; the next use fingerprints the weights again."""
        with self._lock:
            self._suspended = max(0, self._suspended - 1)
            self.epoch += 1
            self._namespace = None
            self._unavailable = None

    def disable(self, reason: str) -> None:
        """Stop using the directory for the rest of this tier's life (say why, once)."""
        with self._lock:
            if self._off_reason is None:
                logger.warning("Prompt-embed cache: directory tier off for this pipeline: %s.", reason)
                self._off_reason = reason
            self.epoch += 1  # results being encoded are not written either

    @property
    def off_reason(self) -> str | None:
        """Why the tier is off or unused now, or None while it is in use."""
        return self._off_reason or self._unavailable

    def _path(self, namespace: str, identity: Hashable) -> Path:
        return self.root / namespace / (identity_name(identity) + SUFFIX)

    def load(
        self, identity: Hashable, witness: tuple, *, claim: bool = True, epoch: int | None = None
    ) -> tuple[bool, Any]:
        """Return ``(True, value)`` from the identity's file, or ``(False, None)``; never raises.

        ``claim``: the caller encodes on a miss. It then holds the entry's claim when it got it:
        until it saves or :meth:`release`-s with the same ``epoch`` (the tier's epoch when its encode
        began; None: now), other processes missing the same entry wait for its file.
        """
        try:
            return self._load(identity, witness, claim, self.epoch if epoch is None else epoch)
        except Exception as error:  # a bug or an environment we did not foresee: a miss, said once
            warn_once(f"a directory read failed ({type(error).__qualname__}: {error}); encoding instead")
            with self._lock:
                self.misses += 1
            return False, None

    def _load(self, identity: Hashable, witness: tuple, claim: bool, epoch: int) -> tuple[bool, Any]:
        namespace = self._namespace_at(epoch)
        if namespace is None:
            return False, None
        self._scan_once(namespace)
        path = self._path(namespace, identity)
        waited = False
        try:
            data = self._read(path)
        except _Rejected as rejected:
            self._reject((epoch, identity), path, str(rejected), claim)
            return False, None
        except OSError:  # absent, or removed by another process meanwhile
            data, waited = self._claim_or_wait((epoch, identity), path) if claim else (None, False)
            if data is None:
                with self._lock:
                    self.misses += 1
                return False, None
        try:
            tensors, metadata = self._decode(data, namespace, identity, witness)
        except _Rejected as rejected:
            self._reject((epoch, identity), path, str(rejected), claim)
            return False, None
        except Exception:  # anything else a damaged file makes the decoder raise
            self._reject((epoch, identity), path, UNREADABLE, claim)
            return False, None
        try:  # a valid file this process cannot place (no memory left on the device): a miss, the file stays
            devices = json.loads(metadata["devices"])
            placed = [tensor.to(self._local_device(device)) for tensor, device in zip(tensors, devices, strict=True)]
        except Exception as error:
            warn_once(f"a directory entry could not be placed ({type(error).__qualname__}: {error})")
            with self._lock:
                self.misses += 1
            return False, None
        with contextlib.suppress(OSError, NotImplementedError):
            os.utime(path, follow_symlinks=False)  # a hit keeps the file recent for the budget's LRU
        with self._lock:
            self.hits += 1
            self.waits += waited
        return True, _rebuild(json.loads(metadata["structure"]), placed)

    def _read(self, path: Path) -> bytes:
        """Return the bytes of the file at ``path``: never through a link, never from a device or pipe
        (raise _Rejected); raise OSError when there is none."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as error:
            if error.errno == errno.ELOOP:  # a link where an entry's file should be
                raise _Rejected(NOT_A_FILE) from None
            raise
        with os.fdopen(fd, "rb") as file:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise _Rejected(NOT_A_FILE)
            if self.max_bytes is not None and status.st_size > LOW_WATER * self.max_bytes:
                raise _Rejected(TOO_LARGE)  # never written here: not worth reading into memory
            if self._key is None and (how := writable_by_others(path, status=status)) is not None:
                self._warn_untrusted(how)
            return file.read()

    def _decode(
        self, data: bytes, namespace: str, identity: Hashable, witness: tuple
    ) -> tuple[list[torch.Tensor], dict[str, str]]:
        """Return a file's value tensors (on the CPU) and metadata, every check passed; raise _Rejected."""
        from safetensors.torch import load

        if self._key is not None:  # before anything else reads the file
            try:
                signed = signature_valid(data, self._key)
            except Exception:
                raise _Rejected(UNREADABLE) from None
            if not signed:
                raise _Rejected(UNSIGNED if signed is None else SIGNATURE)
        try:
            metadata = _read_metadata(data)
            tensors = load(data)
        except Exception:
            raise _Rejected(UNREADABLE) from None
        if metadata.get("format") != FORMAT or metadata.get("namespace") != namespace:
            raise _Rejected(FOREIGN)
        if metadata.get("identity") != repr(identity):
            raise _Rejected(IDENTITY)
        values = [tensors[f"value.{index}"] for index in range(int(metadata["tensors"]))]
        kept = [tensors[f"witness.{index}"] for index in range(int(metadata["witness"]))]
        if _checksum(values + kept, metadata) != metadata.get("checksum"):
            raise _Rejected(CHECKSUM)
        if not witness_matches(tuple(part.numpy().tobytes() for part in kept), witness):
            raise _Rejected(WITNESS)
        return values, metadata

    def save(self, identity: Hashable, witness: tuple[bytes, ...], value: Any, epoch: int | None = None) -> None:
        """Write the entry's file (replacing any), unless the tier was invalidated since ``epoch`` (the
        epoch when its encode began); release its claim. A failure is counted, never raised."""
        try:
            self._save(identity, witness, value, epoch)
        except Exception as error:
            with self._lock:
                self.write_errors += 1
            warn_once(f"a directory write failed ({type(error).__qualname__}: {error}); it stays in memory")
        finally:
            self.release(identity, epoch)

    def _save(self, identity: Hashable, witness: tuple[bytes, ...], value: Any, epoch: int | None) -> None:
        namespace = self._namespace_at(epoch)
        if namespace is None:
            return
        try:
            data = self._encode(namespace, identity, witness, value)
            if self._key is not None:
                data = sign(data, self._key)
        except Unstorable as why:
            self.disable(f"encode_prompt returned {why}, which a file cannot hold")
            return
        if self.max_bytes is not None and len(data) > LOW_WATER * self.max_bytes:
            with self._lock:
                self.write_errors += 1
            warn_once("an entry larger than what the directory's byte budget keeps was not written")
            return
        path = self._path(namespace, identity)
        try:
            if self.modes.make_directory(path.parent):  # the directory was removed under this process
                self._write_atomically(path.parent / "NAMESPACE.json", self._description.encode())
            self._write_atomically(path, data)
        except OSError as error:
            with self._lock:
                self.write_errors += 1
            warn_once(f"cannot write to the directory tier ({error}); entries stay in memory")
            return
        with self._lock:
            self.writes += 1
            self._written_since_scan += len(data)
            self._writes_since_scan += 1
            over = self.max_bytes is not None and self.bytes > self.max_bytes
            due = over or self._scanned_bytes is None or self._writes_since_scan >= RESCAN_EVERY_WRITES
        if due:
            self.enforce_budget()

    @staticmethod
    def _encode(namespace: str, identity: Hashable, witness: tuple[bytes, ...], value: Any) -> bytes:
        from safetensors.torch import save

        originals: list[torch.Tensor] = []
        structure = _structure(value, originals)
        # Owned copies: safetensors refuses tensors that share memory (views of one output).
        values = [tensor.detach().to("cpu", copy=True).contiguous() for tensor in originals]
        kept = [_witness_tensor(part) for part in witness]
        tensors = {f"value.{index}": tensor for index, tensor in enumerate(values)}
        tensors.update({f"witness.{index}": part for index, part in enumerate(kept)})
        metadata = {
            "format": FORMAT,
            "namespace": namespace,
            "identity": repr(identity),
            "structure": json.dumps(structure),
            "devices": json.dumps([str(tensor.device) for tensor in originals]),
            "tensors": str(len(values)),
            "witness": str(len(kept)),
        }
        metadata["checksum"] = _checksum(values + kept, metadata)
        return save(tensors, metadata)

    def _write_atomically(self, path: Path, data: bytes) -> None:
        """Write ``data`` to a new temporary file named after this process, then rename it over ``path``."""
        temporary = path.with_name(f".{path.name}.{owner_tag()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with os.fdopen(self.modes.create(temporary), "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            _remove(temporary)
            raise

    def _reject(self, claim_key: tuple[int, Hashable], path: Path, reason: str, claim: bool) -> None:
        self._discard(path, reason)
        with self._lock:
            self.misses += 1
        if claim:
            self._try_claim(claim_key, path)  # the caller encodes it again: let others wait for that

    def _discard(self, path: Path, reason: str) -> None:
        """Remove a file that must not be used, counting why."""
        _remove(path)
        with self._lock:
            self.rejections[reason] += 1

    def _try_claim(self, claim_key: tuple[int, Hashable], path: Path) -> bool | None:
        """Create the entry's claim file: True if this process now holds it, False if another does, None
        if no claim can be made here (a read-only or missing directory). A claim whose process is gone,
        or older than :attr:`claim_wait_s` (a crashed encoder's on another host), is removed first."""
        claim = path.with_suffix(CLAIM_SUFFIX)
        abandoned = _abandoned_claim(claim, self.claim_wait_s)
        if abandoned is not None and _remove_claim(claim, abandoned):
            with self._lock:
                self.stale_claims += 1
        tag = f"{owner_tag()} {uuid.uuid4().hex}"  # whose claim, and which one of theirs
        try:
            fd = self.modes.create(claim)
        except FileExistsError:
            return False
        except OSError:
            return None
        try:
            os.write(fd, tag.encode())
        except OSError:
            os.close(fd)
            _remove(claim)
            return None
        os.close(fd)
        with self._lock:
            for other in [key for key, (held, _) in self._claims.items() if held == claim]:
                del self._claims[other]  # an earlier claim of this file, voided (released or taken over)
            self._claims[claim_key] = (claim, tag)
        return True

    def _claim_or_wait(self, claim_key: tuple[int, Hashable], path: Path) -> tuple[bytes | None, bool]:
        """Claim a missing entry, or wait for the process that claimed it. Return its file's bytes (None:
        encode it, claimed or after waiting :attr:`claim_wait_s` in vain) and whether this waited for them."""
        deadline = time.monotonic() + self.claim_wait_s
        delay = 0.002
        waited = False
        while True:
            claimed = self._try_claim(claim_key, path)
            if claimed is None:
                return None, waited  # nobody can claim here: encode without waiting
            data = self._read_if_there(path)  # written meanwhile (its claim released), or now
            if claimed:
                if data is not None:
                    self._release(claim_key)
                return data, waited  # None: ours to encode
            if data is not None:
                return data, waited  # the other process finished
            if time.monotonic() >= deadline:
                with self._lock:
                    self.wait_timeouts += 1
                return None, waited
            waited = True
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _read_if_there(self, path: Path) -> bytes | None:
        """Return the file's bytes, or None when there is none; a link or pipe there is removed and counted."""
        try:
            return self._read(path)
        except OSError:
            return None
        except _Rejected as rejected:
            self._discard(path, str(rejected))
            return None

    def release(self, identity: Hashable, epoch: int | None = None) -> None:
        """Give up the entry's claim for an encode that began at ``epoch`` (None: now), if this process
        holds it (its encode ended, saved or not)."""
        self._release((self.epoch if epoch is None else epoch, identity))

    def _release(self, claim_key: tuple[int, Hashable]) -> None:
        with self._lock:
            held = self._claims.pop(claim_key, None)
        if held is not None:
            _remove_claim(*held)  # only while it is still this one: another process may have taken it over

    def enforce_budget(self) -> None:
        """Rescan this package's files under the root; over budget, remove the least recently used down to
        :data:`LOW_WATER` of it. Crashed writers' leftovers go too. Other files are never touched."""
        files: list[tuple[float, int, Path]] = []
        leftovers = 0
        now = time.time()
        try:
            namespaces = [
                each
                for each in os.scandir(self.root)
                if each.is_dir(follow_symlinks=False) and _NAMESPACE_NAME.match(each.name)
            ]
            for namespace in namespaces:
                for entry in os.scandir(namespace.path):
                    try:
                        status = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if _ENTRY_NAME.match(entry.name):
                        files.append((status.st_mtime, status.st_size, Path(entry.path)))
                    elif _leftover(entry.name, Path(entry.path), now - status.st_mtime) and _remove(Path(entry.path)):
                        leftovers += 1
        except OSError:
            return
        total = sum(size for _, size, _ in files)
        removed = 0
        if self.max_bytes is not None and total > self.max_bytes:
            target = LOW_WATER * self.max_bytes
            for _, size, path in sorted(files, key=lambda item: item[0]):
                if total <= target:
                    break
                if _remove(path):
                    removed += 1
                    total -= size
                elif not path.exists():  # another process removed it first
                    total -= size
        with self._lock:
            self._scanned_bytes = total
            self.files = len(files) - removed
            self._written_since_scan = 0
            self._writes_since_scan = 0
            self.evictions += removed
            self.leftovers_removed += leftovers

    def _scan_once(self, namespace: str) -> None:
        """On this tier's first use, remove in the background what crashed processes left in its namespace
        (a claim of a gone process met before that is taken over anyway); :attr:`first_scan` is set after."""
        if self._scanned_once:
            return
        self._scanned_once = True
        threading.Thread(target=self._remove_leftovers, args=(self.root / namespace,), daemon=True).start()

    def _remove_leftovers(self, directory: Path) -> None:
        removed = 0
        now = time.time()
        try:
            for entry in os.scandir(directory):
                with contextlib.suppress(OSError):
                    age = now - entry.stat(follow_symlinks=False).st_mtime
                    if _leftover(entry.name, Path(entry.path), age) and _remove(Path(entry.path)):
                        removed += 1
        except OSError:
            pass
        finally:
            with self._lock:
                self.leftovers_removed += removed
            self.first_scan.set()


class _Rejected(Exception):
    """A file that must not be used; its message is the reason."""


def _read_claim(claim: Path) -> tuple[str, float] | None:
    """Return a claim file's content and age in seconds, or None (absent, a link, unreadable)."""
    try:
        fd = os.open(claim, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, 128).decode("ascii", "replace"), time.time() - os.fstat(fd).st_mtime
    except OSError:
        return None
    finally:
        os.close(fd)


def _abandoned_claim(claim: Path, wait_s: float) -> str | None:
    """Return the content of a claim file whose process is gone, or that is older than ``wait_s``; else None."""
    read = _read_claim(claim)
    if read is None:
        return None
    content, age = read
    return content if owner_gone(content) or age > wait_s else None


def _remove_claim(claim: Path, content: str) -> bool:
    """Remove ``claim`` if it still holds ``content``: a claim another process made since is left alone.
    (Between the read and the removal another process could still replace it: at worst one entry is
    then encoded twice, never served wrong.)"""
    read = _read_claim(claim)
    return read is not None and read[0] == content and _remove(claim)


def _leftover(name: str, path: Path, age: float) -> bool:
    """Return True for a temporary or claim file a crashed process left (its process gone, or old)."""
    if (temporary := _TEMPORARY_NAME.match(name)) is not None:
        return age > STALE_TEMPORARY_S or owner_gone(temporary["owner"])
    if _CLAIM_NAME.match(name):
        return age > STALE_TEMPORARY_S or _abandoned_claim(path, STALE_TEMPORARY_S) is not None
    return False


def _remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False
