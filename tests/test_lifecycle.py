"""When the worker's cache is emptied, and what it reports: sleep (both levels), weight loads, a new pipeline,
log line. LoRA changes are in ``test_lora_hooks.py``."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from engine_support import RELOADING_EXTENSION, MessageCollector, run, tiny_spec

from vllm_omni_prompt_cache import PromptEmbedCacheSettings, install_prompt_embed_cache
from vllm_omni_prompt_cache.demo.rollout import TOKEN_ID_PIPELINE, engine_kwargs, send_rollout
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder
from vllm_omni_prompt_cache.vllm_omni import lifecycle, runner
from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine, worker_value

LOGGER = "vllm_omni_prompt_cache"


@pytest.mark.engine
@pytest.mark.release
def test_engine_sleep_and_weight_loads_empty_the_cache_and_stats_are_logged(monkeypatch, caplog) -> None:
    monkeypatch.setattr(runner, "STATS_LOG_INTERVAL_S", 0.0)  # log on every call (default: every 30 s)
    caplog.set_level(logging.INFO, logger=LOGGER)
    spec = tiny_spec(group_size=2)
    kwargs = {
        **engine_kwargs(spec, "ours", 16, "8MiB"),
        "worker_extension_cls": RELOADING_EXTENSION,
        "enable_sleep_mode": True,  # the worker's sleep, wake and shutdown go through the platform's allocator
    }

    async def scenario() -> dict[str, dict]:
        sizes = {}
        async with open_engine(kwargs) as engine:
            await send_rollout(engine, spec)
            sizes["worker"] = await worker_value(engine, "text_encoder_counters")
            sizes["after rollout"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await engine.collective_rpc("reload_weights", args=("transformer",))
            sizes["after transformer reload"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await engine.collective_rpc("reload_weights", args=("text_encoder",))
            sizes["after text-encoder reload"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await send_rollout(engine, spec)
            sizes["refilled"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await engine.sleep(level=1)
            sizes["after sleep"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await engine.wake_up()
            await send_rollout(engine, spec)
            sizes["after wake"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await engine.collective_rpc("clear_prompt_embed_cache")
            sizes["after rpc clear"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await send_rollout(engine, spec)
            await engine.collective_rpc("re_init_pipeline", args=({"pipeline_class": TOKEN_ID_PIPELINE},))
            sizes["after re-init"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await send_rollout(engine, spec)
            sizes["re-init refilled"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            # Level 2 discards the weights; AsyncOmni 0.30 cannot wake from it, so it comes last.
            await engine.sleep(level=2)
            sizes["after deep sleep"] = await worker_value(engine, "get_prompt_embed_cache_stats")
        return sizes

    worker_errors = MessageCollector(logging.ERROR)
    worker_logger = logging.getLogger("vllm_omni.diffusion.worker.diffusion_worker")  # vLLM's loggers don't propagate
    worker_logger.addHandler(worker_errors)
    try:
        stats = run(scenario())
    finally:
        worker_logger.removeHandler(worker_errors)
    assert worker_errors.messages == []  # e.g. "Failed to release diffusion CuMem pools during shutdown"
    kinds = len(spec.prompts) + 1 + 1  # prompts, the negative prompt, the engine's warm-up prompt
    assert stats["after rollout"]["size"] == kinds
    assert stats["after rollout"]["max_bytes"] == 8 * 2**20
    assert stats["after transformer reload"]["size"] == kinds  # the text encoder did not change
    assert stats["after text-encoder reload"]["size"] == 0
    assert stats["refilled"]["size"] == kinds - 1
    # A level-1 sleep empties device memory; by default its entries wait in host memory (the same
    # weights come back on wake) and serve the prompts sent after the wake.
    assert (stats["after sleep"]["size"], stats["after sleep"]["host_entries"]) == (0, kinds - 1)
    assert stats["after wake"]["misses"] == stats["after sleep"]["misses"]
    assert stats["after wake"]["host_hits"] == stats["after sleep"]["host_hits"] + kinds - 1
    assert stats["after rpc clear"]["size"] == 0
    assert stats["after deep sleep"]["size"] == 0
    assert stats["after re-init"] == {**stats["after re-init"], "size": 0, "hits": 0, "misses": 0}  # a new cache
    refilled = stats["re-init refilled"]  # the new pipeline's cache encodes each prompt once, then hits
    assert (refilled["size"], refilled["misses"]) == (kinds - 1, kinds - 1)
    assert refilled["hits"] == 2 * len(spec.requests()) - (kinds - 1)  # prompt and negative prompt per request
    if stats["worker"]["pid"] != os.getpid():
        return  # a spawned worker (vLLM-Omni 0.27 has only that executor): its log is not this process's
    messages = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert any("cleared" in m and "text-encoder weights are being loaded" in m for m in messages)
    assert any("cleared" in m and "going to sleep" in m for m in messages)
    assert any(m.startswith("Prompt-embed cache: hit rate") for m in messages)


class TracedMask(torch.Tensor):
    """A tensor subclass (tracing / distributed wrappers are such): not read exactly, so it bypasses."""


def test_stats_line_is_rate_limited_and_names_bypass_reasons(caplog) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    now = [100.0]
    logger = lifecycle.StatsLogger(interval_s=10.0, clock=lambda: now[0])
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, max_size=4, settings=PromptEmbedCacheSettings(report=logger))
    ids = torch.tensor([[1, 2, 3]])
    for _ in range(5):
        pipeline.encode_prompt(ids, ids != 0)
    pipeline.encode_prompt(ids, (ids != 0).as_subclass(TracedMask))  # bypasses: its mask reaches the encoder

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == LOGGER]

    assert not lines()  # less than 10 s since the logger started
    now[0] += 11
    pipeline.encode_prompt(ids, ids != 0)
    pipeline.encode_prompt(ids, ids != 0)  # same second: no second line
    assert len(lines()) == 1
    (line,) = lines()
    assert "hit rate 71.4% (5 hits, 1 misses, 1 bypassed)" in line
    assert "1/4 entries" in line
    assert "text encoder input: tensor subclass TracedMask" in line
    now[0] += 60  # the call made in the same second is reported on the next line
    logger(cache)
    assert len(lines()) == 2 and "(6 hits, 1 misses, 1 bypassed)" in lines()[1]
    now[0] += 60  # no calls since the last line: nothing to say
    logger(cache)
    assert len(lines()) == 2


def test_weight_loads_clear_only_for_text_encoder_weights() -> None:
    loaded: list[str] = []

    class Pipeline(TokenIdTextPipeline):
        def load_weights(self, weights):
            loaded.extend(name for name, _ in weights)
            return set(loaded)

    pipeline = Pipeline(build_qwen2_encoder())
    cache = runner.install_for_stage(pipeline, PromptEmbedCacheSettings(enabled=True, max_size=4), "tiny")
    ids = torch.tensor([[4, 5, 6]])
    pipeline.encode_prompt(ids, ids != 0)
    pipeline.load_weights([("transformer.proj.weight", torch.zeros(1))])
    assert len(cache) == 1
    pipeline.load_weights([("text_encoder.embed_tokens.weight", torch.zeros(1))])
    assert len(cache) == 0
    assert loaded == ["transformer.proj.weight", "text_encoder.embed_tokens.weight"]


class WeightSessionWorker:
    """The weight-transfer session of vLLM-Omni 0.32's ``DiffusionWorker``
    (``vllm_omni/diffusion/worker/diffusion_worker.py``: ``start_weight_update()``,
    ``update_weights(update_info: dict)``, ``finish_weight_update()``), with its transfer engine
    reduced to what vLLM's direct engines do: write into the parameters, no ``load_weights``."""

    def __init__(self, pipeline: torch.nn.Module) -> None:
        self.model_runner = type("Runner", (), {"pipeline": pipeline})()
        self._weight_update_active = False

    def sleep(self, level: int = 1) -> None: ...

    def start_weight_update(self) -> None:
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self._weight_update_active = True

    @torch.no_grad()
    def update_weights(self, update_info: dict) -> None:
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        parameters = dict(self.model_runner.pipeline.named_parameters())
        for name, value in update_info.items():
            parameters[name].copy_(value)

    def finish_weight_update(self) -> None:
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self._weight_update_active = False


@pytest.mark.release
def test_a_weight_update_session_empties_the_cache_when_it_starts_and_when_it_finishes() -> None:
    from types import SimpleNamespace

    own = ("sleep", "start_weight_update", "finish_weight_update")  # patched on a class of this test's own
    worker_cls = type(
        "DiffusionWorker", (WeightSessionWorker,), {name: vars(WeightSessionWorker)[name] for name in own}
    )
    lifecycle.patch_worker(SimpleNamespace(DiffusionWorker=worker_cls))
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, max_size=8)
    worker, ids = worker_cls(pipeline), torch.tensor([[5, 6, 7, 8]])
    before = pipeline.encode_prompt(ids)[0]
    assert len(cache) == 1
    worker.start_weight_update()
    assert len(cache) == 0
    name, parameter = next(iter(pipeline.text_encoder.named_parameters()))
    worker.update_weights({f"text_encoder.{name}": parameter + 1})
    pipeline.encode_prompt(ids)  # an encode during the session (half-written weights) is not kept
    worker.finish_weight_update()
    assert len(cache) == 0
    after = pipeline.encode_prompt(ids)[0]
    assert not torch.equal(after, before)  # encoded again, with the new weights
    assert torch.equal(pipeline.encode_prompt(ids)[0], after) and cache.hits >= 1
    # The release's own worker is hooked where it has the session (0.32 and later).
    from vllm_omni_prompt_cache.vllm_omni import plugin

    plugin.register()
    from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

    for method in ("start_weight_update", "finish_weight_update"):
        if method in vars(DiffusionWorker):
            assert getattr(vars(DiffusionWorker)[method], "_prompt_cache_hooked", False), method
