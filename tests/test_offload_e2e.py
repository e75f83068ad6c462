"""The text encoder's moves through the real ``AsyncOmni`` engine on CPU.

vLLM-Omni's module offload (``enable_cpu_offload=True``) runs its hooks on the CPU platform too; the
hooks' device is the host there, so nothing is copied and the counts say what a GPU would move
(see ``vllm_omni_prompt_cache/vllm_omni/offload.py``). Rows encoded are counted by the tiny token-ID
Qwen-Image pipeline itself.
"""

from __future__ import annotations

import pytest
import torch
from engine_support import run, tiny_spec

from vllm_omni_prompt_cache.demo.offload import CONFIGURATIONS, MODULE_OFFLOAD, offload_rollout, run_configurations
from vllm_omni_prompt_cache.demo.rollout import engine_kwargs, send_rollout
from vllm_omni_prompt_cache.settings.schema import ENCODER_ON_MISS
from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine, worker_value


def same_latents(one: dict[int, torch.Tensor], other: dict[int, torch.Tensor]) -> bool:
    return one.keys() == other.keys() and all(torch.equal(one[index], other[index]) for index in one)


@pytest.mark.engine
def test_under_module_offload_a_hit_never_places_the_encoder(tmp_path) -> None:
    """2 prompts x 4 siblings with a shared negative prompt: no cache and vLLM-Omni's cache place the
    encoder for every request; ours once per prompt; ours on a precomputed directory never."""
    spec = tiny_spec()
    requests = len(spec.requests())
    results = run_configurations(spec, CONFIGURATIONS, str(tmp_path / "dir"), offload=MODULE_OFFLOAD)
    off, stock, ours, directory = (results[name] for name in CONFIGURATIONS)
    for result in results.values():
        assert result.placer == "vllm-omni module offload"
        assert same_latents(result.latents, off.latents), result.configuration
    assert off.moves["encoder_placements"] == stock.moves["encoder_placements"] == requests
    assert off.moves["dit_evictions"] == requests and off.rows_encoded == 2 * requests  # prompt and negative
    assert ours.rows_encoded == len(spec.prompts) + 1
    assert ours.moves["encoder_placements"] == len(spec.prompts)  # the negative is encoded beside the first
    assert ours.moves["placements_avoided"] == requests - len(spec.prompts)
    assert ours.moves["bytes_not_moved"] > 0 and off.moves["placements_avoided"] == 0
    assert directory.rows_encoded == 0 and directory.moves["encoder_placements"] == 0
    assert directory.startup_moves["encoder_placements"] == 0  # the warm-up's prompt was in the directory too
    assert directory.moves["placements_avoided"] == requests


@pytest.mark.engine
def test_the_encoder_placed_only_for_a_miss_is_off_the_device_between_requests_and_changes_nothing() -> None:
    """Ours with and without ``prompt_embed_cache_encoder_on_miss``: the same latents; with it the encoder's
    bytes on the device are 0 between requests, also after a level-1 sleep and wake and a second step."""
    spec = tiny_spec()
    new_prompts = tiny_spec(prompts=("a paper boat on a puddle", "a kite above a beach"))
    plain = run(offload_rollout(spec, "ours"))
    kwargs = {**engine_kwargs(spec, "ours", 16, None), ENCODER_ON_MISS.name: True, "enable_sleep_mode": True}

    async def two_steps_with_sleep() -> dict:
        seen: dict = {}
        async with open_engine(kwargs) as engine:
            seen["step 1"] = await send_rollout(engine, spec)
            seen["after step 1"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await engine.sleep(level=1)
            await engine.wake_up()
            seen["step 2"] = await send_rollout(engine, spec)
            seen["after step 2"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await send_rollout(engine, new_prompts)  # misses after the wake: the encoder is placed for them
            seen["after step 3"] = await worker_value(engine, "get_prompt_embed_cache_stats")
        return seen

    seen = run(two_steps_with_sleep())
    assert plain.placer is None  # nothing moves the encoder without offload or the setting
    assert same_latents(seen["step 1"].latents, plain.latents)
    assert same_latents(seen["step 2"].latents, plain.latents)
    first, second, third = seen["after step 1"], seen["after step 2"], seen["after step 3"]
    for stats in (first, second, third):
        assert stats["encoder_placer"] == "on a miss"
        assert stats["encoder_device_bytes"] == 0
        assert stats["encoder_placements"] == stats["encoder_evictions"]
    # Start-up's warm-up and step 1's 3 rows each placed it once. The sleep moved the entries to host
    # memory (the default host tier), so step 2 placed it for nothing; step 3's two new prompts, once each.
    assert first["encoder_placements"] == 1 + len(spec.prompts) + 1
    assert second["encoder_placements"] == first["encoder_placements"]
    assert second["host_hits"] - first["host_hits"] == len(spec.prompts) + 1
    assert third["encoder_placements"] - second["encoder_placements"] == len(new_prompts.prompts)


@pytest.mark.engine
def test_the_setting_with_offload_of_the_encoder_is_refused_at_start() -> None:
    spec = tiny_spec()
    kwargs = {**engine_kwargs(spec, "ours", 16, None), **MODULE_OFFLOAD, ENCODER_ON_MISS.name: True}

    async def start() -> None:
        async with open_engine(kwargs):
            pass

    with pytest.raises(Exception, match=f"invalid {ENCODER_ON_MISS.name}=True from .*module offload moves"):
        run(start())
