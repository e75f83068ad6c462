"""How a shared directory stays within its byte budget, and what crashed writers left is removed.

The budget covers this package's files under the root (every namespace, so stale ones are the
first to go; nothing else under the root is touched): each process counts its own writes and
rescans the root when they would pass the budget, or every :data:`RESCAN_EVERY_WRITES` writes,
removing the least recently used files (a hit refreshes a file's modification time) until
:data:`LOW_WATER` of the budget is used. A rescan also removes temporary and claim files whose
process is gone, or that are older than :data:`STALE_TEMPORARY_S`.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from vllm_omni_prompt_cache.counts.counters import DIR_EVICTIONS, DIR_LEFTOVERS_REMOVED, Count
from vllm_omni_prompt_cache.store.tiers.directory_claims import abandoned_claim, remove_file
from vllm_omni_prompt_cache.store.tiers.directory_trust import owner_gone

#: Writes between two rescans of the root's size (other processes write too).
RESCAN_EVERY_WRITES = 256
#: A rescan over budget removes files until this share of the budget is used.
LOW_WATER = 0.9
#: A temporary or claim file older than this is a crashed writer's: a rescan removes it (sooner when
#: its process is known to be gone).
STALE_TEMPORARY_S = 3600.0

# What this package writes under the root; a rescan touches nothing else.
_NAMESPACE_NAME = re.compile(r"^[0-9a-f]{32}$")
_ENTRY_NAME = re.compile(r"^[0-9a-f]{40}\.safetensors$")
_TEMPORARY_NAME = re.compile(
    r"^\.([0-9a-f]{40}\.safetensors|NAMESPACE\.json)\.(?P<owner>(?:[0-9a-f]{8}-)?\d+)\.[0-9a-f]{8}\.tmp$"
)
_CLAIM_NAME = re.compile(r"^[0-9a-f]{40}\.claim$")


class DirectoryBudget:
    """This package's files under ``root`` within ``max_bytes`` (None: no limit), as this process counts.

    ``count(count, amount)`` adds to the tier's counts: :data:`~.counters.DIR_EVICTIONS` (files removed to stay
    within ``max_bytes``) and :data:`~.counters.DIR_LEFTOVERS_REMOVED` (temporary and claim files of crashed
    processes).
    """

    def __init__(self, root: Path, max_bytes: int | None, count: Callable[[Count, int], None]) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._count = count
        self._lock = threading.Lock()
        self._scanned_bytes: int | None = None  # this package's files under root at the last rescan
        self._written_since_scan = 0
        self._writes_since_scan = 0
        self._scanned_once = False  # the first use removes crashed processes' leftovers, in the background
        self.first_scan = threading.Event()  # set once the first use's removal of leftovers ended
        self.files = 0  # this package's files under root at the last rescan

    @property
    def bytes(self) -> int:
        """Return the bytes of files under the root: the last rescan plus this process's writes since."""
        return (self._scanned_bytes or 0) + self._written_since_scan

    def count_write(self, size: int) -> bool:
        """Count a file of ``size`` bytes this process wrote; return whether a rescan is due (over the
        budget, none made yet, or :data:`RESCAN_EVERY_WRITES` writes since the last)."""
        with self._lock:
            self._written_since_scan += size
            self._writes_since_scan += 1
            over = self.max_bytes is not None and self.bytes > self.max_bytes
            return over or self._scanned_bytes is None or self._writes_since_scan >= RESCAN_EVERY_WRITES

    def enforce(self) -> None:
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
                    path = Path(entry.path)
                    if _ENTRY_NAME.match(entry.name):
                        files.append((status.st_mtime, status.st_size, path))
                    elif _leftover(entry.name, path, now - status.st_mtime) and remove_file(path):
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
                if remove_file(path):
                    removed += 1
                    total -= size
                elif not path.exists():  # another process removed it first
                    total -= size
        with self._lock:
            self._scanned_bytes = total
            self.files = len(files) - removed
            self._written_since_scan = 0
            self._writes_since_scan = 0
        self._count(DIR_EVICTIONS, removed)
        self._count(DIR_LEFTOVERS_REMOVED, leftovers)

    def remove_leftovers_once(self, namespace: str) -> None:
        """On first use, remove in the background what crashed processes left in ``namespace`` (a claim of
        a gone process met before that is taken over anyway); :attr:`first_scan` is set after."""
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
                    path = Path(entry.path)
                    if _leftover(entry.name, path, age) and remove_file(path):
                        removed += 1
        except OSError:
            pass
        finally:
            self._count(DIR_LEFTOVERS_REMOVED, removed)
            self.first_scan.set()


def _leftover(name: str, path: Path, age: float) -> bool:
    """Return True for a temporary or claim file a crashed process left (its process gone, or old)."""
    if (temporary := _TEMPORARY_NAME.match(name)) is not None:
        return age > STALE_TEMPORARY_S or owner_gone(temporary["owner"])
    if _CLAIM_NAME.match(name):
        return age > STALE_TEMPORARY_S or abandoned_claim(path, STALE_TEMPORARY_S) is not None
    return False
