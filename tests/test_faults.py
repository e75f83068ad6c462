"""Faults of other processes on a shared directory, made with real processes and real signals.

Each "other process" is a child Python process running this package's directory tier on a tiny
real Qwen2 encoder (:mod:`fault_child`): one is killed with SIGKILL between writing its temporary
file and renaming it, one is stopped with SIGSTOP while it holds a claim another process waits for.
The test process is the next process on the directory. In each: the call is served, equal to an
uncached encode, nothing is raised, the fault is counted, and what the dead process left is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_tiers import _key_of, encode, files, process, reference, same

CHILD = Path(__file__).with_name("fault_child.py")


def start_child(root: Path, mode: str) -> subprocess.Popen:
    """Start a child that encodes prompt 0 on ``root`` and stops where ``mode`` says; wait until it is there."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(root), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline()
    if line.strip() != "there":
        child.kill()
        pytest.fail(f"the child did not get there: {line!r}\n{child.stderr.read()[-3000:]}")
    return child


def leftovers(root: Path) -> list[str]:
    return sorted(path.name for path in root.glob("*/*") if path.suffix in (".tmp", ".claim"))


def test_a_writer_killed_between_its_temporary_file_and_the_rename(tmp_path) -> None:
    child = start_child(tmp_path, "kill-before-rename")
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert sorted(name.rsplit(".", 1)[-1] for name in leftovers(tmp_path)) == ["claim", "tmp"]
    assert not files(tmp_path)  # the entry was never renamed into place
    reader, cache = process(tmp_path)
    began = time.monotonic()
    assert same(encode(reader, 0), reference(0)) and reader.encoder_runs == 1
    assert time.monotonic() - began < 5  # the dead writer's claim was not waited for
    assert cache.directory.budget.first_scan.wait(10)  # the first use's background removal of leftovers
    stats = cache.snapshot()
    # The claim is taken over by the miss or removed by the scan, whichever comes first; the temporary
    # file only by the scan.
    assert stats.dir_leftovers_removed + stats.dir_stale_claims == 2 and stats.dir_leftovers_removed >= 1
    assert stats.dir_waits == 0 and leftovers(tmp_path) == [] and len(files(tmp_path)) == 1
    again, _ = process(tmp_path)
    assert same(encode(again, 0), reference(0)) and again.encoder_runs == 0


def test_a_claimer_stopped_while_another_process_waits_delays_it_but_never_blocks_it(tmp_path) -> None:
    child = start_child(tmp_path, "stop-while-encoding")
    child.send_signal(signal.SIGSTOP)
    try:
        (claim,) = tmp_path.glob("*/*.claim")
        day = 86_400
        os.utime(claim, (time.time() + day, time.time() + day))  # and a clock a day ahead where it was made
        waiter, cache = process(tmp_path)
        cache.directory.claims.wait_s = 1.0
        began = time.monotonic()
        assert same(encode(waiter, 0), reference(0)) and waiter.encoder_runs == 1
        waited = time.monotonic() - began
        assert 0.9 <= waited < 6  # waited its claims.wait_s for a live claimer, however young the claim looked
        stats = cache.snapshot()
        assert (stats.dir_wait_timeouts, stats.dir_stale_claims, stats.dir_hits) == (1, 0, 0)
        os.utime(claim, (time.time() - 60, time.time() - 60))  # a clock a minute behind: an old claim
        late, cache = process(tmp_path)
        (path,) = files(tmp_path)
        path.unlink()  # the waiter's file gone: the late process misses and meets the old claim
        began = time.monotonic()
        assert cache.directory.get(_key_of(late, 0)) == (False, None)  # a miss, the claim now its own
        assert time.monotonic() - began < 5 and cache.snapshot().dir_stale_claims == 1  # taken over at once
        (claim,) = tmp_path.glob("*/*.claim")
        late_claim = claim.read_text()
    finally:
        child.send_signal(signal.SIGCONT)
    out, err = child.communicate("go on\n", timeout=60)
    assert child.returncode == 0, err[-3000:]
    assert out.strip() == "served the same"  # the resumed claimer's encode equals the others'
    assert claim.read_text() == late_claim  # its release left the late process's claim alone
    cache.directory.release(_key_of(late, 0)[0])
    assert leftovers(tmp_path) == []
    reader, _ = process(tmp_path)
    assert same(encode(reader, 0), reference(0)) and reader.encoder_runs == 0
