"""Who, in which process, is encoding which entry of a shared directory: claim files.

A process that misses an entry claims it while it encodes: an ``O_EXCL`` file beside the entry
(``<name>.claim``) holding ``<host id>-<pid> <random tag>``. Another process missing the same
entry meanwhile waits for the entry's file instead of encoding it too, up to :data:`CLAIM_WAIT_S`,
so replicas that receive one prompt at once encode it once in all.

A claim whose process is gone from this host, or older than the wait (a crashed encoder on
another host), is taken over at once. A claim is removed, on release or take-over, only while it
still holds what was read from it: a claim another process made since is that process's. Between
that read and the removal another process could still replace it: at worst one entry is then
encoded twice, never served wrong.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from pathlib import Path

from vllm_omni_prompt_cache.counts.counters import DIR_STALE_CLAIMS, DIR_WAIT_TIMEOUTS, Count
from vllm_omni_prompt_cache.store.tiers.directory_trust import Modes, owner_gone, owner_tag

CLAIM_SUFFIX = ".claim"
#: How long a process that misses an entry another process is encoding waits for its file
#: before encoding it too (a claim older than this is a crashed encoder's, and is taken over).
CLAIM_WAIT_S = 10.0


class Claims:
    """The claims this process holds on entries of a directory, and the waits for other processes'.

    A claim is held under a key of the caller's choosing (the directory tier's is the epoch its
    encode began in and the key identity), so an encode voided by a clear never releases the claim
    of the encode that replaced it. ``read_entry(path)`` returns an entry file's bytes, or None when
    there is none usable, as carefully as any read of the directory. ``modes``: how claim files are
    created (see :mod:`.directory_trust`). ``count(count, amount)`` adds to the tier's counts:
    :data:`~.counters.DIR_STALE_CLAIMS` (claims of a process that is gone, or silent for :attr:`wait_s`, taken
    over) and :data:`~.counters.DIR_WAIT_TIMEOUTS` (waits for another process's encode that ended without its
    file).
    """

    def __init__(
        self, modes: Modes, read_entry: Callable[[Path], bytes | None], count: Callable[[Count, int], None]
    ) -> None:
        self.modes = modes
        self._read_entry = read_entry
        self._count = count
        self._lock = threading.Lock()
        # The claim files this process holds, by claim key, and what it wrote in each (a claim taken
        # over by another process is not this one's).
        self._held: dict[Hashable, tuple[Path, str]] = {}
        self.wait_s = CLAIM_WAIT_S  # how long a miss waits for another process's encode of its entry

    def try_claim(self, claim_key: Hashable, entry: Path) -> bool | None:
        """Create the entry's claim file: True if this process now holds it, False if another does, None
        if no claim can be made here (a read-only or missing directory). A claim whose process is gone,
        or older than :attr:`wait_s` (a crashed encoder's on another host), is removed first."""
        claim = entry.with_suffix(CLAIM_SUFFIX)
        abandoned = abandoned_claim(claim, self.wait_s)
        if abandoned is not None and _remove_claim(claim, abandoned):
            self._count(DIR_STALE_CLAIMS, 1)
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
            remove_file(claim)
            return None
        os.close(fd)
        with self._lock:
            for other in [key for key, (held, _) in self._held.items() if held == claim]:
                del self._held[other]  # an earlier claim of this file, voided (released or taken over)
            self._held[claim_key] = (claim, tag)
        return True

    def claim_or_wait(self, claim_key: Hashable, entry: Path) -> tuple[bytes | None, bool]:
        """Claim a missing entry, or wait for the process that claimed it. Return its file's bytes (None:
        encode it, claimed or after waiting :attr:`wait_s` in vain) and whether this waited for them."""
        deadline = time.monotonic() + self.wait_s
        delay = 0.002
        waited = False
        while True:
            claimed = self.try_claim(claim_key, entry)
            if claimed is None:
                return None, waited  # nobody can claim here: encode without waiting
            data = self._read_entry(entry)  # written meanwhile (its claim released), or now
            if claimed:
                if data is not None:
                    self.release(claim_key)
                return data, waited  # None: ours to encode
            if data is not None:
                return data, waited  # the other process finished
            if time.monotonic() >= deadline:
                self._count(DIR_WAIT_TIMEOUTS, 1)
                return None, waited
            waited = True
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def release(self, claim_key: Hashable) -> None:
        """Give up the claim held under ``claim_key``, if this process holds it (its encode ended)."""
        with self._lock:
            held = self._held.pop(claim_key, None)
        if held is not None:
            _remove_claim(*held)  # only while it is still this one: another process may have taken it over


def abandoned_claim(claim: Path, wait_s: float) -> str | None:
    """Return the content of a claim file whose process is gone, or that is older than ``wait_s``; else None."""
    read = _read_claim(claim)
    if read is None:
        return None
    content, age = read
    return content if owner_gone(content) or age > wait_s else None


def remove_file(path: Path) -> bool:
    """Remove ``path``; return whether this call removed it (never raise: another process may be first)."""
    try:
        path.unlink()
        return True
    except OSError:
        return False


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


def _remove_claim(claim: Path, content: str) -> bool:
    """Remove ``claim`` if it still holds ``content``: a claim another process made since is left alone."""
    read = _read_claim(claim)
    return read is not None and read[0] == content and remove_file(claim)
