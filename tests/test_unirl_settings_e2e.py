"""How UniRL's settings reach the diffusion worker through the real engine, on both of its routes (``omni_extra``
kwargs alone, or beside a deploy config): every setting arrives, a bad value is refused naming it, and a deploy
YAML's own settings stay beside those of ``omni_extra``. Marked ``release``: on 0.27 and 0.28 the deploy-config
route dropped settings silently. The rollouts of that route: ``test_unirl_e2e.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="UniRL's route needs the vllm-omni extra")

from unirl_support import CACHE_ON, ROUTES, no_cache_env, rollout_of

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
    VERIFY,
    PromptEmbedCacheConfigError,
    carried_settings,
)
from vllm_omni_prompt_cache.tiny import unirl

pytestmark = [pytest.mark.release, pytest.mark.engine]
__all__ = ["no_cache_env"]  # the autouse fixture, imported to apply here


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
