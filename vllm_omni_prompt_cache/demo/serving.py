"""How the load benchmark and the served tests run ``vllm serve TINY --omni`` and read ``/metrics``.

Real servers on loopback, each in its own session (so a stop or a SIGKILL reaches its engine and
replica processes too), asked only what an operator asks: ``/health``, ``/v1/images/generations``
and the Prometheus text on ``/metrics``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from vllm_omni_prompt_cache.demo.replicas import free_port
from vllm_omni_prompt_cache.tiny.qwen_image import checkpoint_dtype

VLLM = str(Path(sys.executable).with_name("vllm"))
METRIC_PREFIX = "vllm_omni:prompt_embed_cache_"
STARTUP_TIMEOUT_S = 300
#: Cheap images: what every served test and the load benchmark ask for.
IMAGE_PARAMETERS = {"size": "64x64", "num_inference_steps": 2}


class ServerError(RuntimeError):
    """The server exited, or did not become healthy in time; the message ends with its log's tail."""


@dataclasses.dataclass
class Server:
    """A ``vllm serve`` process: where it answers, its log, and how long it took to be healthy."""

    process: subprocess.Popen
    base: str
    model: str
    log: Path
    startup_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_until_healthy(self, started: float, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Return once ``/health`` answers; raise ServerError if the server exits or ``timeout_s`` passes."""
        while True:
            if self.process.poll() is not None:
                raise ServerError(f"vllm serve exited with {self.process.returncode}:\n{tail(self.log)}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2):
                    self.startup_s = time.monotonic() - started
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() - started > timeout_s:
                    raise ServerError(f"vllm serve was not healthy in {timeout_s:.0f} s:\n{tail(self.log)}") from None
                time.sleep(1)

    def image(self, prompt: str, seed: int | None = None) -> bytes:
        """Return the PNG bytes the server answers ``prompt`` with (``seed``: None for the server's choice)."""
        payload = {"prompt": prompt, **IMAGE_PARAMETERS, **({} if seed is None else {"seed": seed})}
        answer = post(f"{self.base}/v1/images/generations", payload)
        data = answer["data"][0]["b64_json"]
        if not data:
            raise ServerError(f"no image for {prompt!r}")
        return base64.b64decode(data)

    def counts(self, *families: str) -> dict[str, float]:
        """Return several of the cache's families (short names) from one scrape, each summed over its series."""
        scraped = scrape(self.base)
        return {family: total(scraped, METRIC_PREFIX + family) for family in families}

    def stop(self) -> None:
        """SIGTERM the server's session, then SIGKILL it if it has not exited in 30 s."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server's session: its head, engine and replica processes at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def start(log_path: Path, model_dir: Path, *flags: str) -> Server:
    """Start ``vllm serve MODEL --omni FLAGS`` on a free loopback port; do not wait for it."""
    port = free_port()
    dtype = checkpoint_dtype(model_dir)  # vLLM-Omni builds the denoiser in bf16 unless told
    command = [
        VLLM, "serve", str(model_dir), "--omni", "--host", "127.0.0.1", "--port", str(port),
        *(("--dtype", dtype) if dtype else ()), *flags,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(process, f"http://127.0.0.1:{port}", str(model_dir), Path(log_path))


@contextlib.contextmanager
def served(log_path: Path, model_dir: Path, *flags: str) -> Iterator[Server]:
    """Run ``vllm serve MODEL --omni FLAGS`` until the block ends; yield it once ``/health`` answers."""
    started = time.monotonic()
    server = start(log_path, model_dir, *flags)
    try:
        server.wait_until_healthy(started)
        yield server
    finally:
        server.stop()


def distributed_flags(replicas: int) -> tuple[str, ...]:
    """Return the flags that serve stage 0 with ``replicas`` local replicas behind prompt-affinity."""
    return (
        "--omni-lb-policy", "prompt-affinity", "--stage-id", "0", "--omni-master-address", "127.0.0.1",
        "--omni-master-port", str(free_port()), "--omni-dp-size-local", str(replicas),
    )  # fmt: skip


def tail(path: Path, chars: int = 4000) -> str:
    return Path(path).read_text(errors="replace")[-chars:]


def post(url: str, payload: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def warm_up(server: Server, replicas: int, attempts: int = 40) -> None:
    """Send distinct prompts until ``/metrics`` has series of every replica.

    Counts reach ``/metrics`` riding on outputs, so the engine's start-up warm-up shows only with the
    first request's output: measuring from after this keeps it out. A replica takes requests only
    once the coordinator sees it up, which can be a few requests after ``/health`` answers.
    """
    for attempt in range(attempts):
        server.image(f"warm-up prompt {attempt}", seed=0)
        if len(per_replica(scrape(server.base), "entries")) == replicas:
            return
    raise ServerError(f"only some of {replicas} replicas served {attempts} warm-up requests")


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Return ``/metrics`` as ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(scraped: dict, name: str, **labels: str) -> float:
    """Sum a sample over every series whose labels include ``labels``."""
    return sum(
        value
        for (sample, series), value in scraped.items()
        if sample == name and labels.items() <= dict(series).items()
    )


def series(scraped: dict, name: str) -> list[dict[str, str]]:
    """Return the label sets of a sample's series."""
    return [dict(labels) for sample, labels in scraped if sample == name]


def per_replica(scraped: dict, family: str) -> dict[str, float]:
    """Return one of the cache's families (short name, e.g. ``entries``) summed per replica label."""
    values: dict[str, float] = {}
    for (sample, labels), value in scraped.items():
        if sample == METRIC_PREFIX + family:
            replica = dict(labels).get("replica", "")
            values[replica] = values.get(replica, 0.0) + value
    return dict(sorted(values.items()))


def server_rss(pid: int) -> int:
    """Return the RSS summed over a process and its descendants (pages they share count once per process)."""
    import psutil

    processes = [psutil.Process(pid)]
    processes += processes[0].children(recursive=True)
    rss = 0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            rss += process.memory_info().rss
    return rss
