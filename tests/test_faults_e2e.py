"""Faults under running servers: a replica killed mid-rollout, the directory removed, then read-only.

Three real ``vllm serve TINY --omni`` servers on the CPU platform, started at once: replicas A and B
share one directory tier (on a tmpfs this test mounts, so it can be made read-only for real even as
root), and R serves with no cache at all, for reference images. Every request is compared with R's
image for the same prompt and seed: a wrong embedding would change it. The counts are read from
``/metrics``.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import threading
import time
import urllib.error
from pathlib import Path

import pytest
from engine_support import tiny_spec

from vllm_omni_prompt_cache.counts.counters import DIR_LEFTOVERS_REMOVED
from vllm_omni_prompt_cache.demo import serving
from vllm_omni_prompt_cache.demo.serving import Server
from vllm_omni_prompt_cache.store.tiers.directory import DirectoryTier
from vllm_omni_prompt_cache.store.tiers.directory_trust import host_id

pytestmark = pytest.mark.engine

PROMPTS = ("a fox in the snow", "a heron in the fog", "an otter at dusk", "a lighthouse in the sun")
SEEDS = (0, 1, 2, 3)  # an RL group's siblings


def start(log: Path, *flags: str) -> Server:
    """Start a server that picks its own torch.distributed master port.

    An in-process engine of an earlier test leaves ``MASTER_PORT`` in this process's environment
    (vLLM-Omni's worker sets it); servers started together would all inherit it and settle on the
    same port, so one would fail with EADDRINUSE and start again alone (about 35 s here).
    """
    inherited = os.environ.pop("MASTER_PORT", None)
    try:
        return serving.start(log, tiny_spec().model_dir, *flags)
    finally:
        if inherited is not None:
            os.environ["MASTER_PORT"] = inherited


def start_together(logs_and_flags: dict[str, tuple[Path, tuple[str, ...]]]) -> dict[str, Server]:
    """Start the servers at once and wait for each. Servers starting together can pick the same free
    port for their engine's internal sockets (each probes, then binds later): one that fails with
    EADDRINUSE is started once more, alone, rather than failing the test on the port race."""
    servers = {name: start(log, *flags) for name, (log, flags) in logs_and_flags.items()}
    started = time.monotonic()
    try:
        for name, server in servers.items():
            try:
                server.wait_until_healthy(started)
            except serving.ServerError:
                if "EADDRINUSE" not in serving.tail(server.log, 20_000):
                    raise
                server.stop()
                log, flags = logs_and_flags[name]
                servers[name] = server = start(log, *flags)
                server.wait_until_healthy(time.monotonic())
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


@pytest.fixture
def disk(tmp_path) -> Path:
    """A 64 MiB tmpfs: remounted read-only by the test, it refuses writes even to root."""
    path = tmp_path / "disk"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("this machine does not let the test mount a tmpfs (root and mount are needed)")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


#: What the faults are counted as on B's ``/metrics``.
WATCHED = (
    "dir_hits_total", "dir_misses_total", "dir_writes_total", "dir_write_errors_total", "dir_stale_claims_total",
    "dir_wait_timeouts_total", "dir_leftovers_removed_total",
)  # fmt: skip


def phase(before: dict, after: dict, served: int, wrong: list) -> dict[str, float]:
    """Return a phase's row: requests served, wrong outputs so far, and each watched count's growth."""
    return {"served": served, "wrong": len(wrong), **{name: after[name] - before[name] for name in WATCHED}}


def leftovers(root: Path) -> list[Path]:
    return [path for path in root.glob("*/*") if path.suffix in (".tmp", ".claim")]


def test_replica_killed_mid_rollout_then_directory_removed_then_read_only(tmp_path, disk) -> None:
    root = disk / "cache"
    shared = ("--enable-prompt-embed-cache", "--prompt-embed-cache-size", "1", "--prompt-embed-cache-dir", str(root))
    servers: dict[str, Server] = {}
    try:
        servers = start_together(
            {
                "A": (tmp_path / "a.log", shared),
                "B": (tmp_path / "b.log", shared),
                "R": (tmp_path / "r.log", ("--no-enable-prompt-embed-cache",)),
            }
        )
        a, b, r = servers["A"], servers["B"], servers["R"]
        reference = {(prompt, seed): r.image(prompt, seed) for prompt in PROMPTS for seed in SEEDS}
        wrong: list[tuple] = []

        # 1. A rollout over both replicas; A is killed with SIGKILL after its third image, and what it
        # did not answer is sent again to B, as a driver retries a dead replica's requests.
        requests = [(prompt, seed) for seed in SEEDS for prompt in PROMPTS]
        answered_by_a, a_answered_three, lock = [0], threading.Event(), threading.Lock()
        retried: list[tuple[str, int]] = []

        def serve(index: int, prompt: str, seed: int) -> bytes:
            if index % 2 == 0 and a.process.poll() is None:
                try:
                    image = a.image(prompt, seed)
                except urllib.error.HTTPError:
                    raise  # A answered with an error: a failure, not a dead replica
                except OSError:  # refused, reset or cut off: A is gone
                    retried.append((prompt, seed))
                else:
                    with lock:
                        answered_by_a[0] += 1
                        if answered_by_a[0] == 3:
                            a_answered_three.set()
                    return image
            return b.image(prompt, seed)

        before_kill = b.counts(*WATCHED)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = {pool.submit(serve, index, *request): request for index, request in enumerate(requests)}
            assert a_answered_three.wait(120), "replica A never answered three requests"
            a.kill()
            left_by_a = [path.name for path in leftovers(root)]
            for future, request in futures.items():
                if future.result(timeout=120) != reference[request]:
                    wrong.append(("rollout", request))
        phases = {"replica A killed mid-rollout": phase(before_kill, b.counts(*WATCHED), len(requests), wrong)}

        # 1b. What a replica killed mid-encode leaves, made for certain: each entry's file replaced by A's
        # claim and a temporary file of A's, named after A's (dead) process. B takes every claim over at
        # once, because its process is gone, instead of waiting 10 s for it; the next process removes the
        # temporaries. The claims are dated an hour ahead, so no wait can make them old enough to take
        # over: had B waited, its waits would end in dir_wait_timeouts, with no claim taken over.
        dead, ahead = f"{host_id()}-{a.pid}", time.time() + 3600
        for entry in root.glob("*/*.safetensors"):
            entry.unlink()
            claim = entry.with_suffix(".claim")
            claim.write_text(f"{dead} {'0' * 32}")
            os.utime(claim, (ahead, ahead))
            entry.with_name(f".{entry.name}.{dead}.{'0' * 8}.tmp").write_bytes(b"half a file")
        before = b.counts(*WATCHED)
        for prompt in PROMPTS:
            if b.image(prompt, 2) != reference[(prompt, 2)]:
                wrong.append(("A's leftovers", prompt))
        phases["a killed replica's claims and temporaries"] = counted = phase(
            before, b.counts(*WATCHED), len(PROMPTS), wrong
        )
        assert counted["dir_stale_claims_total"] >= len(PROMPTS) - 1 and counted["dir_wait_timeouts_total"] == 0
        next_process = DirectoryTier(root, None, lambda: "only scanning")  # its rescan, as any process's
        next_process.budget.enforce()
        assert next_process.counts()[DIR_LEFTOVERS_REMOVED] >= len(PROMPTS) - 1
        assert leftovers(root) == [], [path.name for path in leftovers(root)]

        # 2. The directory removed under B: every prompt is encoded again and the directory made anew.
        shutil.rmtree(root)
        before = b.counts(*WATCHED)
        for prompt in PROMPTS:
            if b.image(prompt, 0) != reference[(prompt, 0)]:
                wrong.append(("removed", prompt))
        phases["directory removed"] = counted = phase(before, b.counts(*WATCHED), len(PROMPTS), wrong)
        assert counted["dir_misses_total"] >= len(PROMPTS) - 1  # the last one is in memory
        assert counted["dir_writes_total"] >= len(PROMPTS) - 1
        assert len(list(root.glob("*/*.safetensors"))) >= len(PROMPTS) - 1 and list(root.glob("*/NAMESPACE.json"))

        # 3. Read-only under B: files are still read; a new prompt's write fails, counted, and is served.
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        before = b.counts(*WATCHED)
        for prompt in PROMPTS:
            if b.image(prompt, 1) != reference[(prompt, 1)]:
                wrong.append(("read-only", prompt))
        b.image("a kestrel over the dunes", 0)  # new: encoded, its write refused
        phases["filesystem remounted read-only"] = counted = phase(before, b.counts(*WATCHED), len(PROMPTS) + 1, wrong)
        assert counted["dir_hits_total"] >= len(PROMPTS) - 1 and counted["dir_write_errors_total"] >= 1
        logs = b.log.read_text()
    finally:
        for server in servers.values():
            server.stop()
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=False)
    print(f"retried on B: {len(retried)}; claims and temporaries A left: {left_by_a}; the next process removed "
          f"{next_process.counts()[DIR_LEFTOVERS_REMOVED]}")  # fmt: skip
    for name, counted in phases.items():  # for the record (pytest -s): the fault table of docs/benchmarks.md
        print(f"| {name} | " + " | ".join(f"{value:g}" for value in counted.values()) + " |")
    assert wrong == []
    assert "Traceback" not in logs  # nothing raised into vLLM-Omni
