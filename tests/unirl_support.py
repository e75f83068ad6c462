"""What the UniRL route tests share (``test_unirl_e2e.py``, ``test_unirl_settings_e2e.py``): the engine built as
UniRL's ``native.py`` builds it (``vllm_omni_prompt_cache/tiny/unirl.py`` names the files it mirrors), on either of
its routes, and UniRL's training loop around it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm_omni", reason="UniRL's route needs the vllm-omni extra")

from vllm_omni_prompt_cache.settings.schema import ENABLE, MAX_SIZE
from vllm_omni_prompt_cache.tiny import unirl
from vllm_omni_prompt_cache.tiny.qwen_image import SAMPLE_NEGATIVE_PROMPT, SAMPLE_PROMPTS, ensure_tiny_qwen_image

GROUP_SIZE = 4
#: Four training steps; the dataset comes back to its first prompts after two.
STEPS = (SAMPLE_PROMPTS[0:2], SAMPLE_PROMPTS[2:4], SAMPLE_PROMPTS[0:2], SAMPLE_PROMPTS[2:4])
CACHE_ON = {ENABLE.name: True, MAX_SIZE.name: 32}  # what UniRL PR #449's two config fields forward
ROUTES = ("kwargs", "deploy config")


def without_cache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove the cache's environment variables: what a test gives, and nothing the shell set, reaches the engine."""
    for name in list(os.environ):
        if name.startswith("OMNI_DIFFUSION_PROMPT_EMBED_CACHE"):
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def no_cache_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    without_cache_env(monkeypatch)
    yield


def deploy_config(tmp_path: Path, route: str, pipeline_class: str = unirl.PIPELINE_CLASS, **settings: Any) -> Any:
    if route == "kwargs":
        return None
    path = tmp_path / f"deploy-{len(list(tmp_path.glob('deploy-*')))}.yaml"
    path.write_text(unirl.deploy_config_text(pipeline_class, stage_settings=settings))
    return str(path)


def train(rollout: unirl.UniRLRollout, syncs: tuple[str, ...] = ("transformer",) * len(STEPS)) -> dict[str, list]:
    """UniRL's loop: each step generates, sleeps (level 1), syncs the trained weights, wakes. Returns per step
    the text-encoder runs, each image's pixels and what each request's conditioning tap captured."""
    seen: dict[str, list] = {"runs": [], "images": [], "captures": []}
    for step, (texts, component) in enumerate(zip(STEPS * 2, syncs, strict=False)):
        before = rollout.worker("text_encoder_counters")["encoder_runs"]
        outputs = rollout.generate(
            unirl.grouped_prompts(texts, SAMPLE_NEGATIVE_PROMPT), unirl.sampling_kwargs(GROUP_SIZE, seed=step)
        )
        seen["runs"].append(rollout.worker("text_encoder_counters")["encoder_runs"] - before)
        seen["images"].append([np.asarray(image).tobytes() for output in outputs for image in output.images])
        seen["captures"].append(rollout.worker("captured_conditioning"))
        rollout.sleep()
        rollout.worker("sync_weights", component, step)
        rollout.wake()
    return seen


def rollout_of(
    tmp_path: Path, route: str, omni_extra: dict, pipeline_class: str = unirl.PIPELINE_CLASS, **yaml_settings: Any
) -> Any:
    return unirl.UniRLRollout(
        str(ensure_tiny_qwen_image()),
        omni_extra,
        deploy_config=deploy_config(tmp_path, route, pipeline_class, **yaml_settings),
        pipeline_class=pipeline_class,
    )
