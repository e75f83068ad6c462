"""UniRL's route through the real engine: ``Omni`` in-process, ``omni_extra`` kwargs, a deploy config or
none, string prompts with ``num_outputs_per_prompt``, and a sleep, weight sync and wake every step.

The stand-ins (``vllm_omni_prompt_cache/tiny/unirl.py``) name the UniRL files they mirror. Marked
``release``: ``make test`` runs these on vLLM-Omni 0.30.0, ``make releases`` on every release, 0.28.0
(UniRL's pin) among them. Nothing is mocked: the CPU platform runs the engine, the tiny Qwen-Image
its random weights. How the settings travel on those routes: ``test_unirl_settings_e2e.py``.

Every cached run here is compared with one uncached run (``uncached``, shared by the module): the same
prompts, seeds and weight syncs give the same images and captures whatever the route or tap, so one
engine is the reference of all four, where each test used to start its own (on 0.27.0rc1 an engine's
worker is a spawned process, about 25 s to start). It takes the deploy-config route, the one that used
to drop settings, so that the cache is seen off there when none is given; the uncached runs each route's
release fact records are that run's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm_omni", reason="UniRL's route needs the vllm-omni extra")

from unirl_support import CACHE_ON, ROUTES, STEPS, no_cache_env, rollout_of, train, without_cache_env

from vllm_omni_prompt_cache.tiny import unirl

pytestmark = [pytest.mark.release, pytest.mark.engine]
__all__ = ["no_cache_env"]  # the autouse fixture, imported to apply here

#: Each step's weight sync: the DiT, but a text-encoder sync before the fifth step.
SYNCS = ("transformer", "transformer", "transformer", "text_encoder", "transformer")


@pytest.fixture(scope="module")
def uncached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list]]:
    """Five steps of UniRL's loop with no cache setting given (a deploy config beside an empty ``omni_extra``),
    through the conditioning tap's class (installed at the first forward; it only records what the encode
    returned)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        without_cache_env(monkeypatch)
        scratch = tmp_path_factory.mktemp("uncached")
        with rollout_of(scratch, "deploy config", {}, unirl.TAP_AFTER_CACHE) as rollout:
            seen = train(rollout, SYNCS)
    # The cache is off: a prompt and the negative prompt encoded per request, at every step.
    assert seen["runs"] == [2 * len(STEPS[0])] * len(SYNCS)
    yield seen


@pytest.mark.parametrize("route", ROUTES)
def test_entries_outlive_every_steps_sleep_and_outputs_match_uncached(
    tmp_path, route, uncached, record_release_fact
) -> None:
    """The DiT changes every step, the text encoder does not: the prompts steps 3 and 4 repeat encode nothing.
    A fifth step syncs text-encoder weights: what follows it is encoded again."""
    with rollout_of(tmp_path, route, dict(CACHE_ON)) as cached_rollout:
        cached = train(cached_rollout, SYNCS)
        stats = cached_rollout.worker("get_prompt_embed_cache_stats")
    # Step 1 encodes its two prompts and the negative once (one prompt a call: no rows to check); step 2 its two
    # new prompts (the negative waited in host memory); steps 3 and 4 nothing; step 5 follows the text encoder's
    # sync and encodes its prompts and the negative again.
    assert cached["runs"] == [3, 2, 0, 0, 3]
    assert cached["images"] == uncached["images"]  # bit-identical, image by image (max_num_seqs 1)
    assert stats["hits"] > 0
    record_release_fact(
        f"UniRL route ({route}): text-encoder runs per step, uncached and cached (sleep + DiT sync every step)",
        f"{uncached['runs'][:4]}, {cached['runs'][:4]}",
    )


@pytest.mark.parametrize("pipeline_class", [unirl.TAP_AFTER_CACHE, unirl.TAP_BEFORE_CACHE], ids=["after", "before"])
def test_the_conditioning_tap_captures_on_hits_what_it_captures_uncached(tmp_path, pipeline_class, uncached) -> None:
    """HV1.5's tap stores the request's first encode on ``self._captured_conditioning``; installed after the
    cache (as HV1.5 does, at its first forward) or before it, a hit must leave what a miss leaves."""
    with rollout_of(tmp_path, "kwargs", dict(CACHE_ON), pipeline_class) as cached_rollout:
        cached = train(cached_rollout)  # four steps, each followed by a DiT sync: the reference's first four
        stats = cached_rollout.worker("get_prompt_embed_cache_stats")
    for step_captures in cached["captures"]:
        unirl.conditioning_of(step_captures)  # UniRL's output adapter raises when one is missing
    # The engine's warm-up request is the first capture of the first step, in both runs.
    assert cached["captures"] == uncached["captures"][: len(STEPS)]
    assert cached["images"] == uncached["images"][: len(STEPS)]
    assert stats["hits"] > 0 and sum(cached["runs"]) < sum(uncached["runs"][: len(STEPS)])
