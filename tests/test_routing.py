"""Prompt-affinity keys, consistent hashing with bounded loads, and the router built on them."""

from __future__ import annotations

import math
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vllm_omni_prompt_cache.calls.routing import (
    DEFAULT_EPSILON,
    EPSILON_ENV,
    BoundedLoadRing,
    PromptAffinityRouter,
    UnroutableRequest,
    epsilon_from_env,
    least_loaded,
    prompt_affinity_key,
)
from vllm_omni_prompt_cache.settings.schema import PromptEmbedCacheConfigError

IDS = [151644, 872, 198, 64, 2518, 38835]
NEGATIVE = [151644, 872, 198, 220]
REPLICAS = [f"tcp://10.0.0.{index}:5000" for index in range(8)]


# ---- prompt_affinity_key ---------------------------------------------------------------------


def test_token_ids_key_by_value_whatever_holds_them():
    forms = [
        IDS,
        tuple(IDS),
        np.array(IDS, dtype=np.int32),
        torch.tensor(IDS),
        torch.tensor([IDS]),  # a leading batch of one
        torch.tensor(IDS, dtype=torch.int32).t(),  # any layout
    ]
    keys = {prompt_affinity_key({"prompt_ids": ids, "negative_prompt_ids": NEGATIVE}) for ids in forms}
    assert len(keys) == 1
    # vLLM's spelling shares the slot with the adapters' one.
    assert prompt_affinity_key({"prompt_token_ids": IDS, "negative_prompt_token_ids": NEGATIVE}) in keys


def test_only_prompt_content_enters_the_key():
    base = {"prompt_ids": IDS, "negative_prompt_ids": NEGATIVE}
    key = prompt_affinity_key(base)
    assert prompt_affinity_key({**base, "seed": 7, "request_id": "r-1", "extra_args": {"x": 1}}) == key
    assert prompt_affinity_key({**base, "prompt_ids": [*IDS[:-1], 7]}) != key
    assert prompt_affinity_key({**base, "negative_prompt_ids": [*NEGATIVE, 1]}) != key
    assert prompt_affinity_key({"prompt_ids": IDS}) != key  # the negative prompt counts
    assert prompt_affinity_key({"prompt_ids": IDS, "negative_prompt_ids": None}) == prompt_affinity_key(
        {"prompt_ids": IDS}
    )


def test_text_prompts_and_objects():
    assert prompt_affinity_key("a red fox") == prompt_affinity_key({"prompt": "a red fox"})
    assert prompt_affinity_key("a red fox") != prompt_affinity_key("a red fox ")
    assert prompt_affinity_key({"prompt": "fox", "negative_prompt": "blurry"}) != prompt_affinity_key("fox")

    class EngineRequest:  # an object with vLLM's attribute names, such as an EngineCoreRequest
        prompt_token_ids = IDS

    assert prompt_affinity_key(EngineRequest()) == prompt_affinity_key({"prompt_token_ids": IDS})


def test_media_keys_by_content():
    red = Image.new("RGB", (8, 8), (255, 0, 0))
    key = prompt_affinity_key({"prompt": "edit", "multi_modal_data": {"image": red}})
    assert prompt_affinity_key({"prompt": "edit", "multi_modal_data": {"image": red.copy()}}) == key
    blue = Image.new("RGB", (8, 8), (0, 0, 255))
    assert prompt_affinity_key({"prompt": "edit", "multi_modal_data": {"image": blue}}) != key


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        ({}, "no prompt content"),
        ({"prompt_embeds": torch.zeros(1, 4)}, "no prompt content"),
        ({"prompt_ids": [1.5, 2.0]}, "prompt_tokens are not integers"),
        ({"prompt_ids": [[1, 2], [3]]}, "prompt_tokens are not"),
        ({"prompt": "x", "multi_modal_data": {"image": object()}}, "media cannot be keyed: unsupported type"),
        (["a", "b"], "a list of prompts is not one request"),
        ({"prompt_ids": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}, "prompt_tokens are not integers"),
        ({"prompt_ids": torch.empty(3, dtype=torch.int64, device="meta")}, "prompt_tokens are not an array"),
        ({"prompt_embeds": torch.zeros(1, 4), "negative_prompt": "blurry"}, "no prompt content"),
    ],
)
def test_requests_without_usable_prompt_content_say_why(request_, reason):
    with pytest.raises(UnroutableRequest, match=reason):
        prompt_affinity_key(request_)


def keys_in_two_processes() -> set[str]:
    code = (
        "from vllm_omni_prompt_cache.calls.routing import prompt_affinity_key as k; "
        f"print(k({{'prompt_ids': {IDS}, 'negative_prompt': 'blurry'}}), k('a red fox'))"
    )
    return {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2")
    }


def test_key_is_the_same_in_every_process():
    runs = keys_in_two_processes()
    here = (
        f"{prompt_affinity_key({'prompt_ids': IDS, 'negative_prompt': 'blurry'})} {prompt_affinity_key('a red fox')}\n"
    )
    assert runs == {here}


# ---- the load slack --------------------------------------------------------------------------


def test_epsilon_from_the_environment():
    assert epsilon_from_env({}) == DEFAULT_EPSILON
    assert epsilon_from_env({EPSILON_ENV: " 0 "}) == 0.0
    assert epsilon_from_env({EPSILON_ENV: "1.5"}) == 1.5


@pytest.mark.parametrize("text", ["abc", "-1", "-0.1", "nan", "inf", ""])
def test_bad_epsilon_names_the_variable_and_what_is_allowed(text):
    with pytest.raises(PromptEmbedCacheConfigError) as error:
        epsilon_from_env({EPSILON_ENV: text})
    assert (
        EPSILON_ENV in str(error.value) and "finite number >= 0" in str(error.value) and repr(text) in str(error.value)
    )


def test_bad_ring_arguments():
    with pytest.raises(PromptEmbedCacheConfigError, match="BoundedLoadRing"):
        BoundedLoadRing(epsilon=True)
    with pytest.raises(ValueError, match="virtual_nodes"):
        BoundedLoadRing(virtual_nodes=0)
    ring = BoundedLoadRing()
    with pytest.raises(ValueError, match="must not be empty"):
        ring.choose("k", [], [])
    with pytest.raises(ValueError, match="2 loads for 3 replicas"):
        ring.choose("k", REPLICAS[:3], [0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        ring.choose("k", REPLICAS[:2], [0, -1])
    with pytest.raises(ValueError, match="distinct"):
        ring.choose("k", [REPLICAS[0], REPLICAS[0]], [0, 0])


# ---- BoundedLoadRing -------------------------------------------------------------------------


def test_capacity_is_ceil_of_one_plus_epsilon_times_the_mean():
    ring = BoundedLoadRing(epsilon=0.25)
    assert [ring.capacity(total, 4) for total in (1, 4, 13, 16, 100)] == [1, 2, 5, 5, 32]
    assert BoundedLoadRing(epsilon=0).capacity(9, 4) == 3  # never below the mean


@settings(max_examples=200, deadline=None)
@given(
    replica_count=st.integers(1, 12),
    epsilon=st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.3, 1.0]),
    events=st.lists(st.one_of(st.integers(0, 40), st.just(None)), min_size=1, max_size=200),
)
def test_no_replica_ever_exceeds_the_bound(replica_count, epsilon, events):
    """Arrivals (a prompt number) and finishes (None) in any order; the bound is checked exactly."""
    router = PromptAffinityRouter(epsilon=epsilon)
    names = [f"replica-{index}" for index in range(replica_count)]
    in_flight: list[int] = []  # the replica of each unfinished request
    for event in events:
        if event is None:
            if in_flight:
                in_flight.pop(0)
            continue
        loads = [in_flight.count(index) for index in range(replica_count)]
        index = router.route(f"prompt-{event}" if event % 5 else None, names, loads)
        in_flight.append(index)
        bound = math.ceil((1 + Fraction(str(epsilon))) * Fraction(len(in_flight), replica_count))
        assert in_flight.count(index) <= bound
    assert router.peak_load_over_bound <= 1.0


def test_the_bound_is_exact_for_decimal_slacks():
    assert BoundedLoadRing(epsilon=0.1).capacity(100, 2) == 55  # 1.1 * 50, not one more from float rounding
    assert BoundedLoadRing(epsilon=0.3).capacity(10, 1) == 13


def test_keys_go_home_while_loads_allow():
    ring = BoundedLoadRing(epsilon=0.25)
    keys = [f"prompt-{index}" for index in range(200)]
    homes = [ring.home(key, REPLICAS) for key in keys]
    assert all(ring.choose(key, REPLICAS, [10] * 8) == home for key, home in zip(keys, homes, strict=True))
    shares = np.bincount(homes, minlength=8)
    assert shares.min() > 0 and shares.max() < 2.5 * shares.mean()


def test_a_spilled_key_goes_to_the_next_replica_with_room():
    ring = BoundedLoadRing(epsilon=0.25)
    home = ring.home("prompt-1", REPLICAS)
    loads = [0] * 8
    loads[home] = 3  # cap for 4 in flight over 8 replicas is ceil(1.25 * 4 / 8) = 1
    spilled = ring.choose("prompt-1", REPLICAS, loads)
    assert spilled != home
    assert ring.place("prompt-1", REPLICAS, loads) == (spilled, False)
    assert ring.place("prompt-1", REPLICAS, [0] * 8) == (home, True)
    loads[spilled] = 3
    again = ring.choose("prompt-1", REPLICAS, loads)
    assert again not in (home, spilled)
    # The same walk for every sibling: they spill together.
    assert ring.choose("prompt-1", REPLICAS, loads) == again


def test_adding_or_removing_a_replica_moves_only_its_share():
    ring = BoundedLoadRing()
    keys = [f"prompt-{index}" for index in range(2000)]
    before = {key: REPLICAS[ring.home(key, REPLICAS)] for key in keys}
    grown = [*REPLICAS, "tcp://10.0.0.99:5000"]
    after = {key: grown[ring.home(key, grown)] for key in keys}
    moved = [key for key in keys if after[key] != before[key]]
    assert moved and all(after[key] == grown[-1] for key in moved)
    assert len(moved) < 2 * len(keys) / len(grown)
    shrunk = [name for name in REPLICAS if name != REPLICAS[3]]
    after = {key: shrunk[ring.home(key, shrunk)] for key in keys}
    assert {key for key in keys if after[key] != before[key]} == {key for key in keys if before[key] == REPLICAS[3]}


def test_order_of_the_replica_list_does_not_matter():
    ring = BoundedLoadRing()
    reordered = list(reversed(REPLICAS))
    for index in range(100):
        key = f"prompt-{index}"
        assert REPLICAS[ring.home(key, REPLICAS)] == reordered[ring.home(key, reordered)]


# ---- PromptAffinityRouter --------------------------------------------------------------------


def test_siblings_follow_a_spilled_first_request():
    router = PromptAffinityRouter(epsilon=0.25)
    key = prompt_affinity_key({"prompt_ids": IDS})
    home = router.ring.home(key, REPLICAS)
    loads = [4] * 8
    loads[home] = 6  # cap for 35 in flight over 8 is ceil(1.25 * 35 / 8) = 6: the home is full
    first = router.route(key, REPLICAS, loads)
    assert first != home
    loads[first] += 1
    loads[home] -= 1  # the home has room again (5 < 6), but the warm replica is where the first went
    assert router.route(key, REPLICAS, loads) == first
    assert router.placements == {"spilled": 1, "with siblings": 1}
    assert router.peak_load_over_bound == 1.0  # the sibling filled the warm replica to its bound, no further


def test_requests_without_a_key_go_least_loaded_and_are_counted():
    router = PromptAffinityRouter()
    assert router.route(None, REPLICAS[:3], [4, 1, 2], reason="no prompt content") == 1
    assert router.fallback_reasons == {"no prompt content": 1}
    assert router.placements == {"least-loaded": 1}
    assert least_loaded([3, 0, 0]) in (1, 2)


def test_the_router_remembers_a_bounded_number_of_prompts():
    router = PromptAffinityRouter(remembered=4)
    for index in range(10):
        router.route(f"prompt-{index}", REPLICAS, [0] * 8)
    assert len(router._warm_replicas) == 4
