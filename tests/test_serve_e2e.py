"""`vllm serve MODEL --omni` with the cache flags: a real server on loopback, on the CPU platform.

Three identical text-to-image requests through the stock Qwen-Image pipeline: the first encodes,
the next two hit. Statistics come from vLLM's dev-mode ``/collective_rpc`` route, calling the
``get_prompt_embed_cache_stats`` method the plugin adds to the diffusion worker.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from engine_support import tiny_spec

from vllm_omni_prompt_cache.tiny.qwen_image import checkpoint_dtype

pytestmark = pytest.mark.engine
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(url: str, payload: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    model_dir = tiny_spec().model_dir
    command = [
        vllm, "serve", str(model_dir), "--omni", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", checkpoint_dtype(model_dir),  # vLLM-Omni builds the denoiser in bf16 unless told
        "--enable-prompt-embed-cache", "--prompt-embed-cache-size", "8", "--prompt-embed-cache-max-bytes", "64MiB",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not start in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
                time.sleep(1)
        yield base
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def worker_stats(base: str) -> dict:
    (stage_results,) = post(f"{base}/collective_rpc", {"method": "get_prompt_embed_cache_stats"})["results"]
    (stats,) = stage_results
    return stats


def test_serve_flags_configure_the_cache_and_repeated_prompts_hit(server) -> None:
    before = worker_stats(server)
    assert (before["max_size"], before["max_bytes"], before["verify"]) == (8, 64 * 2**20, True)
    for _ in range(3):
        image = post(
            f"{server}/v1/images/generations",
            {"prompt": "a red fox in the snow", "size": "64x64", "num_inference_steps": 2, "seed": 7},
        )
        assert image["data"][0]["b64_json"]
    after = worker_stats(server)
    assert after["misses"] - before["misses"] == 1
    assert after["hits"] - before["hits"] == 2
    assert after["bypassed"] == before["bypassed"]
