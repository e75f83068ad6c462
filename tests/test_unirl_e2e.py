"""UniRL's route through the real engine: ``Omni`` in-process, ``omni_extra`` kwargs, a deploy config or
none, string prompts with ``num_outputs_per_prompt``, and a sleep, weight sync and wake every step.

The stand-ins (``vllm_omni_prompt_cache/tiny/unirl.py``) name the UniRL files they mirror. Marked
``release``: ``make test`` runs these on vLLM-Omni 0.30.0, ``make releases`` on every release, 0.28.0
(UniRL's pin) among them. Nothing is mocked: the CPU platform runs the engine, the tiny Qwen-Image
its random weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm_omni", reason="UniRL's route needs the vllm-omni extra")

from vllm_omni_prompt_cache.settings.schema import (
    AUDIT,
    BACKEND,
    DIRECTORY,
    DIRECTORY_BYTES,
    DIRECTORY_GROUP,
    DIRECTORY_KEY_FILE,
    ENABLE,
    ENCODER_ON_MISS,
    FIND_ENCODES,
    HOST_BYTES,
    MAX_BYTES,
    MAX_SIZE,
    METHODS,
    ROW_LAYOUTS,
    VERIFY,
    PromptEmbedCacheConfigError,
    carried_settings,
)
from vllm_omni_prompt_cache.tiny import unirl
from vllm_omni_prompt_cache.tiny.qwen_image import SAMPLE_NEGATIVE_PROMPT, SAMPLE_PROMPTS, ensure_tiny_qwen_image

pytestmark = [pytest.mark.release, pytest.mark.engine]

GROUP_SIZE = 4
#: Four training steps; the dataset comes back to its first prompts after two.
STEPS = (SAMPLE_PROMPTS[0:2], SAMPLE_PROMPTS[2:4], SAMPLE_PROMPTS[0:2], SAMPLE_PROMPTS[2:4])
CACHE_ON = {ENABLE.name: True, MAX_SIZE.name: 32}  # what UniRL PR #449's two config fields forward
ROUTES = ("kwargs", "deploy config")


@pytest.fixture(autouse=True)
def no_cache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OMNI_DIFFUSION_PROMPT_EMBED_CACHE"):
            monkeypatch.delenv(name)


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


@pytest.mark.parametrize("route", ROUTES)
def test_entries_outlive_every_steps_sleep_and_outputs_match_uncached(tmp_path, route, record_release_fact) -> None:
    """The DiT changes every step, the text encoder does not: the prompts steps 3 and 4 repeat encode nothing.
    A fifth step syncs text-encoder weights: what follows it is encoded again."""
    syncs = ("transformer", "transformer", "transformer", "text_encoder", "transformer")
    with rollout_of(tmp_path, route, {}) as uncached_rollout:
        uncached = train(uncached_rollout, syncs)
    with rollout_of(tmp_path, route, dict(CACHE_ON)) as cached_rollout:
        cached = train(cached_rollout, syncs)
        stats = cached_rollout.worker("get_prompt_embed_cache_stats")
    assert uncached["runs"] == [2 * len(STEPS[0])] * 5  # a prompt and the negative prompt per request
    # Step 1 encodes its two prompts and the negative once, plus the first use's check of the row layout;
    # step 2 its two new prompts (the negative waited in host memory); steps 3 and 4 nothing; step 5 follows
    # the text encoder's sync and encodes its prompts and the negative again.
    assert cached["runs"] == [4, 2, 0, 0, 3]
    assert cached["images"] == uncached["images"]  # bit-identical, image by image (max_num_seqs 1)
    assert stats["proven_hits"] == stats["hits"] > 0
    record_release_fact(
        f"UniRL route ({route}): text-encoder runs per step, uncached and cached (sleep + DiT sync every step)",
        f"{uncached['runs'][:4]}, {cached['runs'][:4]}",
    )


@pytest.mark.parametrize("pipeline_class", [unirl.TAP_AFTER_CACHE, unirl.TAP_BEFORE_CACHE], ids=["after", "before"])
def test_the_conditioning_tap_captures_on_hits_what_it_captures_uncached(tmp_path, pipeline_class) -> None:
    """HV1.5's tap stores the request's first encode on ``self._captured_conditioning``; installed after the
    cache (as HV1.5 does, at its first forward) or before it, a hit must leave what a miss leaves."""
    with rollout_of(tmp_path, "kwargs", {}, pipeline_class) as uncached_rollout:
        uncached = train(uncached_rollout)
    with rollout_of(tmp_path, "kwargs", dict(CACHE_ON), pipeline_class) as cached_rollout:
        cached = train(cached_rollout)
        stats = cached_rollout.worker("get_prompt_embed_cache_stats")
    for step_captures in cached["captures"]:
        unirl.conditioning_of(step_captures)  # UniRL's output adapter raises when one is missing
    # The engine's warm-up request is the first capture of the first step, in both runs.
    assert cached["captures"] == uncached["captures"]
    assert cached["images"] == uncached["images"]
    assert stats["hits"] > 0 and sum(cached["runs"]) < sum(uncached["runs"])


def every_setting(tmp_path: Path) -> dict[str, Any]:
    """A value for every setting, other than its default but for the backend (the directory's key file and
    group included)."""
    key_file = tmp_path / "directory.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    return {
        ENABLE.name: True,
        MAX_SIZE.name: 7,
        MAX_BYTES.name: "3MiB",
        VERIFY.name: False,
        BACKEND.name: "content-keyed",  # its default, given: the other backend refuses encoder_on_miss
        ROW_LAYOUTS.name: f"{unirl.PIPELINE_CLASS}=qwen-image-text",
        METHODS.name: f"{unirl.PIPELINE_CLASS}=encode_prompt",
        FIND_ENCODES.name: False,
        HOST_BYTES.name: "5MiB",
        DIRECTORY.name: str(tmp_path / "tier"),
        DIRECTORY_BYTES.name: "6MiB",
        DIRECTORY_KEY_FILE.name: str(key_file),
        DIRECTORY_GROUP.name: os.getegid(),
        ENCODER_ON_MISS.name: True,
        AUDIT.name: 0.25,
    }


EXPECTED = {
    ENABLE.name: True,
    MAX_SIZE.name: 7,
    MAX_BYTES.name: 3 * 2**20,
    VERIFY.name: False,
    BACKEND.name: "content-keyed",
    ROW_LAYOUTS.name: {unirl.PIPELINE_CLASS: "qwen-image-text"},
    METHODS.name: {unirl.PIPELINE_CLASS: "encode_prompt"},
    FIND_ENCODES.name: False,
    HOST_BYTES.name: 5 * 2**20,
    DIRECTORY_BYTES.name: 6 * 2**20,
    DIRECTORY_GROUP.name: os.getegid(),
    ENCODER_ON_MISS.name: True,
    AUDIT.name: 0.25,
}


@pytest.mark.parametrize("route", ROUTES)
def test_every_setting_in_omni_extra_arrives_at_the_worker(tmp_path, route, record_release_fact) -> None:
    """On 0.27 and 0.28 the deploy-config route dropped every setting but vLLM-Omni's own two, silently."""
    given = every_setting(tmp_path)
    assert set(given) == {setting.name for setting in carried_settings()}  # a new setting must be added here
    with rollout_of(tmp_path, route, given) as rollout:
        resolved = rollout.worker("resolved_cache_settings")
    assert {name: resolved[name] for name in EXPECTED} == EXPECTED
    assert all(source != "default" for source in resolved["sources"].values()), resolved["sources"]
    assert resolved[DIRECTORY.name] == str(tmp_path / "tier")
    assert resolved[DIRECTORY_KEY_FILE.name] == str(tmp_path / "directory.key")
    arrived = sum(source != "default" for source in resolved["sources"].values())
    record_release_fact(
        f"UniRL route ({route}): settings given in omni_extra that reached the worker",
        f"{arrived}/{len(carried_settings())}",
    )


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("setting", "value"), [(HOST_BYTES.name, "bogus"), (MAX_BYTES.name, "abc"), (AUDIT.name, "2"), (VERIFY.name, "?")]
)
def test_a_bad_value_in_omni_extra_is_refused_naming_the_setting(tmp_path, route, setting, value) -> None:
    with pytest.raises(PromptEmbedCacheConfigError) as raised:
        rollout_of(tmp_path, route, {**CACHE_ON, setting: value}).close()
    assert f"invalid {setting}={value!r}" in str(raised.value)


def test_the_deploy_yamls_own_settings_and_extras_stay_beside_those_of_omni_extra(tmp_path) -> None:
    """On 0.27 and 0.28 a stage's extras override replaced the YAML's extras: ours are merged setting by setting."""
    with rollout_of(
        tmp_path, "deploy config", {**CACHE_ON, MAX_BYTES.name: "3MiB"}, **{VERIFY.name: "off", AUDIT.name: 0.5}
    ) as rollout:
        resolved = rollout.worker("resolved_cache_settings")
    assert (resolved[MAX_BYTES.name], resolved[VERIFY.name], resolved[AUDIT.name]) == (3 * 2**20, False, 0.5)
    assert resolved["sources"][VERIFY.name].startswith("diffusion stage config")
    # and the caller's value wins over the YAML's, as vLLM-Omni's own precedence has it
    with rollout_of(tmp_path, "deploy config", {**CACHE_ON, AUDIT.name: 0.25}, **{AUDIT.name: 0.5}) as rollout:
        assert rollout.worker("resolved_cache_settings")[AUDIT.name] == 0.25
