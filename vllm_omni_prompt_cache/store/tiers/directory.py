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
  instead of encoding it too, up to :data:`.directory_claims.CLAIM_WAIT_S`, so replicas that
  receive one prompt at once encode it once in all. A claim whose process no longer exists is
  taken over at once (see :mod:`.directory_claims`);
* with a signing key, a file without a valid signature is refused; a link where a file should be
  is never followed; what this package creates is not writable by group or others unless a shared
  group is configured (see :mod:`.directory_trust`).

An entry is looked up in the namespace's shards first (``precompute --pack`` moves entry files
there, many a file, see :mod:`.directory_shards`), then as a file of its own; a packed entry is
decoded and checked as a file. A shard is read-only here: a damaged one serves nothing more, a
packed entry that fails a file's checks is refused alone; neither is removed.

The byte budget covers this package's files under the root, every namespace; a rescan removes
the least recently used files (a hit refreshes a file's modification time) and crashed writers'
leftovers, and touches nothing else (see :mod:`.directory_budget`). Which namespace is in use,
and whether any, is :class:`Namespaced`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from vllm_omni_prompt_cache.counts.counters import (
    DIR_HITS,
    DIR_MISSES,
    DIR_REJECTIONS,
    DIR_WAITS,
    DIR_WRITE_ERRORS,
    DIR_WRITES,
    Count,
    Keeper,
    read_counts,
    zero_counts,
)
from vllm_omni_prompt_cache.keys.call_key import CallKey
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.store.entries import Entry
from vllm_omni_prompt_cache.store.shared_heads import whole_value
from vllm_omni_prompt_cache.store.tiers.directory_budget import LOW_WATER, DirectoryBudget
from vllm_omni_prompt_cache.store.tiers.directory_claims import Claims, remove_file
from vllm_omni_prompt_cache.store.tiers.directory_files import (
    DAMAGED_SHARD,
    REFUSED_PACKED,
    SUFFIX,
    UNREADABLE,
    Rejected,
    Unstorable,
    decode_entry,
    encode_entry,
    identity_name,
    read_entry_file,
    rebuilt_value,
    warn_untrusted,
)
from vllm_omni_prompt_cache.store.tiers.directory_shards import ShardError, Shards
from vllm_omni_prompt_cache.store.tiers.directory_trust import (
    PRIVATE,
    Modes,
    owner_tag,
    sign,
    writable_by_others,
)
from vllm_omni_prompt_cache.store.tiers.tier import Keeps, Stamp

logger = logging.getLogger(__name__)


class Namespaced:
    """Which namespace a tier's entries go under now, if any: ``fingerprint()`` digested once per epoch.

    :attr:`epoch` counts what voids results being encoded (new weights, a suspend or resume, the tier
    turned off), so a result computed before one is never written under the namespace after it.
    :meth:`_describe` is called with the text a new namespace digests, the namespace lock held (a use
    of the namespace waits).
    """

    def __init__(self, fingerprint: Callable[[], dict[str, Any] | str]) -> None:
        self._fingerprint = fingerprint
        self._namespace_lock = threading.Lock()
        self.epoch = 0  # bumped by clear(), suspend(), resume() and disable()
        self.current_namespace: str | None = None  # the namespace of this epoch, once computed
        self._off_reason: str | None = None  # set by disable(): for the rest of this tier's life
        self._unavailable: str | None = None  # the fingerprint's reason, until clear()
        self._suspended = 0  # suspend() calls not yet resumed: weights are changing

    @property
    def namespace(self) -> str | None:
        """Return this process's namespace (a hex digest), computing it if needed; None when unusable."""
        return self.namespace_at(None)

    def namespace_at(self, epoch: int | None) -> str | None:
        """Return the namespace, or None when unusable or when ``epoch`` is not the current one (None: now)."""
        with self._namespace_lock:
            if self._off_reason is not None or self._unavailable is not None or self._suspended:
                return None
            if epoch is not None and epoch != self.epoch:
                return None  # the weights changed since the caller's encode began
            if self.current_namespace is None:
                try:
                    described = self._fingerprint()
                    text = described if isinstance(described, str) else json.dumps(described, sort_keys=True)
                except Exception as error:  # an encoder or tokenizer we cannot read: no directory, no error
                    described = text = f"the fingerprint failed ({type(error).__qualname__}: {error})"
                if isinstance(described, str):
                    self._unavailable = described
                    logger.warning("Prompt-embed cache: directory tier unused: %s.", described)
                    return None
                self.current_namespace = hashlib.sha256(text.encode()).hexdigest()[:32]
                self._describe(self.current_namespace, text)
            return self.current_namespace

    def _describe(self, namespace: str, description: str) -> None:
        """Record what produced a new namespace's entries (``description``, what it digests)."""

    def clear(self) -> None:
        """Forget the namespace: what produces entries changed (new text-encoder weights). The files of the
        old one stay, for processes still on those weights; this one never reads them again."""
        with self._namespace_lock:
            self.epoch += 1
            self.current_namespace = None
            self._unavailable = None

    def suspend(self) -> None:
        """Neither read nor write until :meth:`resume`: text-encoder weights are changing, and what is
        encoded meanwhile belongs to no namespace."""
        with self._namespace_lock:
            self._suspended += 1
            self.epoch += 1

    def resume(self) -> None:
        """End a :meth:`suspend`; the next use fingerprints the weights again."""
        with self._namespace_lock:
            self._suspended = max(0, self._suspended - 1)
            self.epoch += 1
            self.current_namespace = None
            self._unavailable = None

    def disable(self, reason: str) -> None:
        """Stop using the directory for the rest of this tier's life (say why, once)."""
        with self._namespace_lock:
            if self._off_reason is None:
                logger.warning("Prompt-embed cache: directory tier off for this pipeline: %s.", reason)
                self._off_reason = reason
            self.epoch += 1  # results being encoded are not written either

    @property
    def off_reason(self) -> str | None:
        """Why the tier is off or unused now, or None while it is in use."""
        return self._off_reason or self._unavailable


class DirectoryTier(Namespaced):
    """Entries as files under ``root``, within ``max_bytes`` (None: no limit): a :class:`~.tier.Tier`
    that keeps every encoded entry.

    ``fingerprint()`` returns a JSON-able description of what produces this process's entries, or a
    string saying why there is none (then the tier is unused until :meth:`clear`). It runs on first
    use and again after each :meth:`clear` (new weights); see :class:`Namespaced`.
    ``local_device(recorded)`` maps the device a file's tensor was encoded on to this process's.
    ``key``: the signing key (None: files are neither signed nor required to be); ``modes``: how
    directories and files are created (see :mod:`.directory_trust`). Its :attr:`budget` keeps the
    files within ``max_bytes``; its :attr:`claims` are the entries this process is encoding.
    """

    keeps = Keeps.ENCODES

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
        super().__init__(fingerprint)
        self.root = Path(root)
        self._key = key
        self.modes = modes
        self.budget = DirectoryBudget(self.root, max_bytes, self._count)
        self.claims = Claims(modes, self._read_if_there, self._count)
        self._description = ""  # what produced the namespace's entries (its NAMESPACE.json)
        self.local_device = local_device
        self._lock = threading.Lock()
        self._shards: Shards | None = None  # the current namespace's packed entries, read in place
        # Counts since the tier was made, read by the store's snapshot through counts(); its budget and claims
        # count here too. DIR_WRITE_ERRORS: writes that failed or were refused (too large for the budget);
        # DIR_REJECTIONS: files removed on read, packed entries refused, by reason.
        self._counts = zero_counts(Keeper.DIRECTORY)

    def _count(self, count: Count, amount: int = 1) -> None:
        """Add ``amount`` to ``count``."""
        with self._lock:
            self._counts[count] += amount

    def _reject_count(self, reason: str) -> None:
        """Count one file removed, or packed entry refused, for ``reason``."""
        with self._lock:
            self._counts[DIR_REJECTIONS][reason] += 1

    def counts(self) -> dict[Count, Any]:
        """Return the directory tier's counts since it was made (its budget's and its claims' included)."""
        with self._lock:
            return read_counts(self._counts)

    def _describe(self, namespace: str, description: str) -> None:
        """Write ``NAMESPACE.json`` (what produced the namespace's files), for people; the namespace lock held."""
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
                    warn_untrusted(how)
                    break

    def _path(self, namespace: str, identity: Hashable) -> Path:
        return self.root / namespace / (identity_name(identity) + SUFFIX)

    def get(self, key: CallKey, *, claim: bool = True, epoch: int | None = None) -> tuple[bool, Any]:
        """Return ``(True, value)`` from the key's file, or ``(False, None)``; never raises.

        ``claim``: the caller encodes on a miss. It then holds the entry's claim when it got it:
        until it puts or :meth:`release`-s with the same ``epoch`` (the tier's epoch when its encode
        began; None: now), other processes missing the same entry wait for its file.
        """
        try:
            return self._get(key.identity, key.witness, claim, self.epoch if epoch is None else epoch)
        except Exception as error:  # a bug or an environment we did not foresee: a miss, said once
            warn_once(f"a directory read failed ({type(error).__qualname__}: {error}); encoding instead")
            self._count(DIR_MISSES)
            return False, None

    def _get(self, identity: Hashable, witness: tuple, claim: bool, epoch: int) -> tuple[bool, Any]:
        namespace = self.namespace_at(epoch)
        if namespace is None:
            return False, None
        self.budget.remove_leftovers_once(namespace)
        path = self._path(namespace, identity)
        waited = False
        data = self._packed(namespace, path)  # first: a packed entry costs no open of a file of its own
        packed = data is not None
        if data is None:
            try:
                data = read_entry_file(path, self.budget.max_bytes, self._key)
            except Rejected as rejected:
                self._reject((epoch, identity), path, str(rejected), claim)
                return False, None
            except OSError:  # absent, or removed by another process meanwhile (a pack may just have moved it)
                data = self._packed(namespace, path, fresh=True)
                packed = data is not None
                if data is None and claim:
                    data, waited = self.claims.claim_or_wait((epoch, identity), path)
                if data is None:
                    self._count(DIR_MISSES)
                    return False, None
        try:
            tensors, metadata = decode_entry(data, namespace, identity, witness, self._key)
        except Exception as error:  # Rejected, or anything else a damaged file makes the decoder raise
            reason = str(error) if isinstance(error, Rejected) else UNREADABLE
            if packed:  # never removed: shards are read-only data a job prepared
                self._packed_rejected(namespace, path, reason, (epoch, identity), claim)
            else:
                self._reject((epoch, identity), path, reason, claim)
            return False, None
        try:  # a valid file this process cannot place (no memory left on the device): a miss, the file stays
            devices = json.loads(metadata["devices"])
            placed = [tensor.to(self.local_device(device)) for tensor, device in zip(tensors, devices, strict=True)]
        except Exception as error:
            warn_once(f"a directory entry could not be placed ({type(error).__qualname__}: {error})")
            self._count(DIR_MISSES)
            return False, None
        if not packed:
            with contextlib.suppress(OSError, NotImplementedError):
                os.utime(path, follow_symlinks=False)  # a hit keeps the file recent for the budget's LRU
        with self._lock:
            self._counts[DIR_HITS] += 1
            self._counts[DIR_WAITS] += waited
        return True, rebuilt_value(json.loads(metadata["structure"]), placed)

    def shards(self, namespace: str) -> Shards:
        """Return the packed entries of ``namespace`` (read on first use, again when a pack changes them); those
        of an earlier namespace (older weights) are closed, as nothing reads them again."""
        with self._lock:
            if self._shards is None or self._shards.namespace != namespace:
                if self._shards is not None:
                    self._shards.close()
                self._shards = Shards(self.root / namespace, namespace)
            return self._shards

    def _packed(self, namespace: str, path: Path, *, fresh: bool = False) -> bytes | None:
        """Return the entry's bytes from the namespace's shards, or None; a damaged shard counts a rejection."""
        try:
            return self.shards(namespace).read(path.name, fresh=fresh)
        except ShardError:  # said once, naming the shard
            self._reject_count(DAMAGED_SHARD)
            return None

    def _packed_rejected(
        self, namespace: str, path: Path, reason: str, claim_key: tuple[int, Hashable], claim: bool
    ) -> None:
        """A packed entry whose bytes match the index but fail a file's checks: that entry is refused (never
        removed: shards are read-only data), the rest of its shard still serves."""
        self.shards(namespace).refuse(path.name, reason)
        self._reject_count(REFUSED_PACKED)
        self._count(DIR_MISSES)
        if claim:
            self.claims.try_claim(claim_key, path)

    def put(self, identity: Hashable, entry: Entry, stamp: Stamp) -> None:
        """Write the entry's file (replacing any; ``entry.witness``: the key's bytes), unless the tier moved
        on since ``stamp.epoch`` (the epoch when its encode began); release its claim. A failure is
        counted, never raised."""
        try:
            self._write(identity, entry.witness, whole_value(entry.value), stamp.epoch)
        except Exception as error:
            self._count(DIR_WRITE_ERRORS)
            warn_once(f"a directory write failed ({type(error).__qualname__}: {error}); it stays in memory")
        finally:
            self.release(identity, stamp.epoch)

    def _write(self, identity: Hashable, witness: tuple[bytes, ...], value: Any, epoch: int) -> None:
        namespace = self.namespace_at(epoch)
        if namespace is None:
            return
        try:
            data = encode_entry(namespace, identity, witness, value)
            if self._key is not None:
                data = sign(data, self._key)
        except Unstorable as why:
            self.disable(f"encode_prompt returned {why}, which a file cannot hold")
            return
        if self.budget.max_bytes is not None and len(data) > LOW_WATER * self.budget.max_bytes:
            self._count(DIR_WRITE_ERRORS)
            warn_once("an entry larger than what the directory's byte budget keeps was not written")
            return
        path = self._path(namespace, identity)
        try:
            if self.modes.make_directory(path.parent):  # the directory was removed under this process
                self._write_atomically(path.parent / "NAMESPACE.json", self._description.encode())
            self._write_atomically(path, data)
        except OSError as error:
            self._count(DIR_WRITE_ERRORS)
            warn_once(f"cannot write to the directory tier ({error}); entries stay in memory")
            return
        self._count(DIR_WRITES)
        if self.budget.count_write(len(data)):
            self.budget.enforce()

    def _write_atomically(self, path: Path, data: bytes) -> None:
        """Write ``data`` to a new temporary file named after this process, then rename it over ``path``."""
        temporary = path.with_name(f".{path.name}.{owner_tag()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with os.fdopen(self.modes.create(temporary), "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            remove_file(temporary)
            raise

    def _reject(self, claim_key: tuple[int, Hashable], path: Path, reason: str, claim: bool) -> None:
        self._discard(path, reason)
        self._count(DIR_MISSES)
        if claim:
            self.claims.try_claim(claim_key, path)  # the caller encodes it again: let others wait for that

    def _discard(self, path: Path, reason: str) -> None:
        """Remove a file that must not be used, counting why."""
        remove_file(path)
        self._reject_count(reason)

    def _read_if_there(self, path: Path) -> bytes | None:
        """Return the file's bytes, or None when there is none; a link or pipe there is removed and counted."""
        try:
            return read_entry_file(path, self.budget.max_bytes, self._key)
        except OSError:
            return None
        except Rejected as rejected:
            self._discard(path, str(rejected))
            return None

    def release(self, identity: Hashable, epoch: int | None = None) -> None:
        """Give up the entry's claim for an encode that began at ``epoch`` (None: now), if this process
        holds it (its encode ended, written or not)."""
        self.claims.release((self.epoch if epoch is None else epoch, identity))

    def levels(self) -> dict[str, Any]:
        """Return the files and bytes under the root (as last counted), the budget, the root and why the tier
        is unused (None: in use), as :class:`~.stats.CacheStats` fields."""
        budget = self.budget
        return {
            "dir_files": budget.files,
            "dir_bytes": budget.bytes,
            "dir_max_bytes": budget.max_bytes,
            "directory": str(self.root),
            "dir_off_reason": self.off_reason,
        }
