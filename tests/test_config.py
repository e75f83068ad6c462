"""How settings resolve: env var over keyword argument over default; bad values named clearly."""

from __future__ import annotations

import pytest

from vllm_omni_prompt_cache.settings.resolved import (
    PromptEmbedCacheSettings,
    resolve_prompt_embed_cache_config,
    resolve_prompt_embed_cache_settings,
    resolve_settings,
)
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
    REMOVED,
    VERIFY,
    PromptEmbedCacheConfigError,
    carried_settings,
)


@pytest.fixture(autouse=True)
def no_cache_env(monkeypatch) -> None:
    for setting in carried_settings():
        monkeypatch.delenv(setting.env, raising=False)


def test_defaults_match_upstream() -> None:
    assert resolve_prompt_embed_cache_config() == (False, 32)
    settings = resolve_prompt_embed_cache_settings()
    assert (settings.max_bytes, settings.verify) == (None, True)
    assert set(settings.sources.values()) == {"default"}


def test_keyword_arguments_apply() -> None:
    assert resolve_prompt_embed_cache_config(enable=True, max_size=64) == (True, 64)


def test_environment_overrides_keyword_arguments(monkeypatch) -> None:
    monkeypatch.setenv(ENABLE.env, "off")
    monkeypatch.setenv(MAX_SIZE.env, "8")
    monkeypatch.setenv(MAX_BYTES.env, "1.5GiB")
    monkeypatch.setenv(VERIFY.env, "no")
    settings = resolve_prompt_embed_cache_settings(enable=True, max_size=64, max_bytes=10, verify=True)
    assert (settings.enabled, settings.max_size, settings.max_bytes, settings.verify) == (
        False,
        8,
        int(1.5 * 2**30),
        False,
    )
    assert settings.sources[MAX_SIZE.name] == f"environment variable {MAX_SIZE.env}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("TRUE", True), (" yes ", True), ("on", True), ("0", False), ("False", False)],
)
def test_boolean_spellings(monkeypatch, text, expected) -> None:
    monkeypatch.setenv(ENABLE.env, text)
    assert resolve_prompt_embed_cache_config()[0] is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", 1), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("4096", 4096), ("none", None), ("1 kib", 1024)],
)
def test_byte_budget_spellings(monkeypatch, text, expected) -> None:
    monkeypatch.setenv(MAX_BYTES.env, text)
    assert resolve_prompt_embed_cache_settings().max_bytes == expected


@pytest.mark.parametrize(
    ("setting", "bad"),
    [
        (MAX_SIZE, "0"),
        (MAX_SIZE, "-1"),
        (MAX_SIZE, "abc"),
        (MAX_SIZE, ""),
        (MAX_SIZE, "1.5"),
        (ENABLE, "maybe"),
        (ENABLE, ""),
        (VERIFY, "2"),
        (MAX_BYTES, "0"),
        (MAX_BYTES, "-5"),
        (MAX_BYTES, "12 parsecs"),
        (MAX_BYTES, "0.1"),
        (BACKEND, "fast"),
        (BACKEND, ""),
        (HOST_BYTES, "0"),
        (HOST_BYTES, "-1"),
        (HOST_BYTES, "abc"),
        (HOST_BYTES, "none"),  # a host tier without a limit is not offered: host memory is shared
        (DIRECTORY, ""),
        (DIRECTORY, "/proc/no-such-directory"),
        (DIRECTORY_BYTES, "0"),
        (DIRECTORY_BYTES, "-1"),
        (DIRECTORY_BYTES, "lots"),
        (FIND_ENCODES, "abc"),
        (FIND_ENCODES, "-1"),
        (FIND_ENCODES, ""),
        (ENCODER_ON_MISS, "abc"),
        (ENCODER_ON_MISS, "-1"),
        (ENCODER_ON_MISS, ""),
    ],
)
def test_bad_environment_values_name_setting_source_and_allowed(monkeypatch, setting, bad) -> None:
    monkeypatch.setenv(setting.env, bad)
    with pytest.raises(PromptEmbedCacheConfigError) as raised:
        resolve_prompt_embed_cache_settings()
    message = str(raised.value)
    assert setting.name in message
    assert f"environment variable {setting.env}" in message
    assert setting.allowed in message
    assert repr(bad) in message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_size": 0},
        {"max_size": -1},
        {"max_size": True},
        {"max_size": 2.0},
        {"enable": "maybe"},
        {"enable": 2},
    ],
)
def test_bad_keyword_values_are_rejected(kwargs) -> None:
    with pytest.raises(PromptEmbedCacheConfigError, match="from keyword argument"):
        resolve_prompt_embed_cache_config(**kwargs)


def test_the_error_is_a_value_error_as_callers_of_upstream_expect() -> None:
    with pytest.raises(ValueError):
        resolve_prompt_embed_cache_config(max_size=0)


def test_each_setting_parses_its_own_values() -> None:
    assert MAX_BYTES.parse("2KiB", "test") == 2048
    assert MAX_BYTES.parse("none", "test") is None
    assert ENABLE.parse(" On ", "test") is True
    assert MAX_SIZE.parse("16", "test") == 16
    assert BACKEND.parse("vllm-omni", "test") == "vllm-omni"
    with pytest.raises(PromptEmbedCacheConfigError, match=r"invalid prompt_embed_cache_size='0' from a test: expected"):
        MAX_SIZE.parse("0", "a test")


def test_settings_survive_the_trip_to_the_worker_whole(monkeypatch) -> None:
    monkeypatch.setenv(MAX_BYTES.env, "1KiB")
    settings = resolve_prompt_embed_cache_settings(
        enable=True,
        max_size=8,
        verify=False,
        backend="vllm-omni",
        methods="pkg.mod.Adapter=encode_ids+_encode_negative",
        encoder_on_miss="on",
        audit="5%",
        find_encodes="off",
    )
    carried = settings.as_dict()
    assert carried == {
        ENABLE.name: True,
        MAX_SIZE.name: 8,
        MAX_BYTES.name: 1024,
        VERIFY.name: False,
        BACKEND.name: "vllm-omni",
        METHODS.name: {"pkg.mod.Adapter": "encode_ids+_encode_negative"},
        FIND_ENCODES.name: False,
        HOST_BYTES.name: "auto",  # the default: what a level-1 sleep drops waits in host memory
        DIRECTORY.name: None,
        DIRECTORY_BYTES.name: 16 * 2**30,
        DIRECTORY_KEY_FILE.name: None,
        DIRECTORY_GROUP.name: None,
        ENCODER_ON_MISS.name: True,
        AUDIT.name: 0.05,
        "sources": settings.sources,
        "directory_key_id": None,
    }
    assert PromptEmbedCacheSettings.from_dict(carried, "the stage config") == settings


@pytest.mark.parametrize(("given", "expected"), [(None, "auto"), ("auto", "auto"), (" AUTO ", "auto"), ("off", None)])
def test_the_host_tier_keeps_a_sleeps_entries_unless_turned_off_and_off_survives_the_trip(given, expected) -> None:
    settings = resolve_prompt_embed_cache_settings(enable=True, host_bytes=given)
    assert settings.host_bytes == expected
    assert PromptEmbedCacheSettings.from_dict(settings.as_dict(), "the stage config").host_bytes == expected


def test_tier_settings_parse_and_survive_the_trip(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(DIRECTORY_BYTES.env, "none")
    settings = resolve_prompt_embed_cache_settings(host_bytes="64MiB", directory=tmp_path / "new" / "tier")
    assert settings.host_bytes == 64 * 2**20
    assert settings.directory == str(tmp_path / "new" / "tier")  # made, absolute
    assert (tmp_path / "new" / "tier").is_dir()
    assert settings.directory_bytes is None  # no limit, from the environment
    carried = settings.as_dict()
    assert carried[DIRECTORY_BYTES.name] == "none"  # not None: that would read back as the 16 GiB default
    assert PromptEmbedCacheSettings.from_dict(carried, "the stage config") == settings
    assert HOST_BYTES.parse("off", "test") is None and DIRECTORY.parse("off", "test") is None


def test_a_directory_that_is_a_file_is_refused_naming_the_setting(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(PromptEmbedCacheConfigError, match=r"invalid prompt_embed_cache_dir=.* from keyword argument"):
        resolve_prompt_embed_cache_settings(directory=str(blocker), environ={})


def test_a_carried_value_that_went_bad_or_unknown_is_refused() -> None:
    with pytest.raises(PromptEmbedCacheConfigError, match="from the stage config prompt_embed_cache_size"):
        PromptEmbedCacheSettings.from_dict({MAX_SIZE.name: -3, "sources": {}}, "the stage config")
    with pytest.raises(PromptEmbedCacheConfigError, match=r"unknown prompt-embed cache setting\(s\) \['size'\]"):
        PromptEmbedCacheSettings.from_dict({"size": 3, "sources": {}}, "the stage config")


#: The row-layout setting was removed (a batched call's rows are cut where they reach the text encoder).
ROW_LAYOUTS_NAME = "prompt_embed_cache_row_layouts"
ROW_LAYOUTS_ENV = "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_ROW_LAYOUTS"


def test_the_removed_row_layout_setting_is_refused_by_name_wherever_it_is_given() -> None:
    assert {ROW_LAYOUTS_NAME, ROW_LAYOUTS_ENV, "row_layouts"} <= set(REMOVED)
    for value in ("pkg.mod.A=token-ids", {"pkg.mod.A": "token-ids"}):
        with pytest.raises(PromptEmbedCacheConfigError) as raised:
            resolve_settings({ROW_LAYOUTS_NAME: value}, source="keyword argument", environ={})
        assert f"keyword argument {ROW_LAYOUTS_NAME}" in str(raised.value) and "removed" in str(raised.value)
    with pytest.raises(PromptEmbedCacheConfigError) as raised:
        resolve_prompt_embed_cache_settings(environ={ROW_LAYOUTS_ENV: "pkg.mod.C=token-ids"})
    assert f"environment variable {ROW_LAYOUTS_ENV}" in str(raised.value) and "removed" in str(raised.value)
    with pytest.raises(PromptEmbedCacheConfigError, match="the setting row_layouts given as a keyword argument was"):
        PromptEmbedCacheSettings(row_layouts={"pkg.mod.A": "token-ids"})


def test_the_removed_row_layout_env_var_is_refused_even_when_the_cache_is_off(monkeypatch) -> None:
    monkeypatch.setenv(ROW_LAYOUTS_ENV, "pkg.mod.A=token-ids")
    with pytest.raises(PromptEmbedCacheConfigError, match=ROW_LAYOUTS_ENV):
        resolve_prompt_embed_cache_config()
    monkeypatch.delenv(ROW_LAYOUTS_ENV)
    assert resolve_prompt_embed_cache_config() == (False, 32)


def test_a_stage_config_carrying_the_removed_row_layouts_is_refused_naming_it() -> None:
    carried = {**PromptEmbedCacheSettings().as_dict(), ROW_LAYOUTS_NAME: {"pkg.mod.A": "token-ids"}}
    with pytest.raises(PromptEmbedCacheConfigError, match=ROW_LAYOUTS_NAME):
        PromptEmbedCacheSettings.from_dict(carried, "the stage config")


@pytest.mark.parametrize(
    "value",
    [
        "abc",
        "pkg.mod.Adapter",  # no method
        "pkg.mod.Adapter=",
        "Adapter=encode_ids",  # not a class path
        "pkg.mod.Adapter=encode ids",
        "pkg.mod.Adapter=encode_ids+encode_ids",
        "pkg.mod.Adapter=a,pkg.mod.Adapter=b",  # a class twice
        "pkg.mod.Adapter=1st",
        "",
        0,
        -1,
        {"pkg.mod.Adapter": [1]},  # a method that is not a name
        {"pkg.mod.Adapter": []},
    ],
)
def test_a_bad_methods_value_names_the_setting_its_source_and_the_form(value) -> None:
    with pytest.raises(PromptEmbedCacheConfigError) as raised:
        resolve_prompt_embed_cache_settings(methods=value, source="a test")
    message = str(raised.value)
    assert message.startswith(f"invalid {METHODS.name}={value!r} from a test {METHODS.name}: expected CLASS=METHOD")


def test_methods_parse_from_the_environment_over_the_keyword(monkeypatch) -> None:
    monkeypatch.setenv(METHODS.env, " pkg.mod.A = encode_ids + _encode_negative , pkg.other.B=embed ")
    settings = resolve_prompt_embed_cache_settings(methods="pkg.mod.Z=ignored")
    assert settings.methods == {"pkg.mod.A": ("encode_ids", "_encode_negative"), "pkg.other.B": ("embed",)}
    assert settings.sources[METHODS.name] == f"environment variable {METHODS.env}"
    monkeypatch.setenv(METHODS.env, "garbage")
    with pytest.raises(PromptEmbedCacheConfigError, match=f"from environment variable {METHODS.env}: expected"):
        resolve_prompt_embed_cache_settings()


# --- one schema: every surface is made from config.SETTINGS -------------------------------------------


def test_the_docs_table_is_made_from_the_settings() -> None:
    """docs/user-guide.md's table is config.settings_table() as it is now (`make docs-table` writes it)."""
    from pathlib import Path

    from vllm_omni_prompt_cache.settings.schema import TABLE_END, TABLE_START, settings_table

    guide = (Path(__file__).parents[1] / "docs" / "user-guide.md").read_text()
    written = guide.partition(TABLE_START)[2].partition(TABLE_END)[0].strip()
    assert written == settings_table(), "docs/user-guide.md's settings table is stale: run `make docs-table`"


def test_install_takes_upstreams_keywords_and_one_settings_object() -> None:
    import inspect

    from vllm_omni_prompt_cache import install_prompt_embed_cache

    parameters = inspect.signature(install_prompt_embed_cache).parameters
    assert list(parameters) == ["pipeline", "max_size", "enabled", "model_tag", "settings"]
    assert [parameters[name].default for name in ("max_size", "enabled", "model_tag")] == [32, True, None]


def test_a_new_setting_is_one_entry_and_reaches_kwargs_flags_env_and_the_worker(monkeypatch) -> None:
    """One line of table, and the setting is an AsyncOmni kwarg, a serve flag, an env var, an attribute of
    the settings object, a column of the docs table, and travels to the worker."""
    import argparse

    from vllm_omni_prompt_cache.settings import schema as config
    from vllm_omni_prompt_cache.settings.schema import Setting, settings_table
    from vllm_omni_prompt_cache.vllm_omni import settings as carried
    from vllm_omni_prompt_cache.vllm_omni.cli_args import add_prompt_cache_arguments

    knob = Setting(
        "prompt_embed_cache_knob",
        "knob",
        "--prompt-embed-cache-knob",
        "OMNI_KNOB",
        3,
        "1-9",
        "A knob.",
        lambda v: int(v) if str(v).isdigit() and 1 <= int(v) <= 9 else None,
        metavar="K",
    )
    monkeypatch.setattr(config, "SETTINGS", (*config.SETTINGS, knob))  # the one line

    assert PromptEmbedCacheSettings().knob == 3  # its default, on the settings object
    resolved, kept = carried._resolved_in_caller({"prompt_embed_cache_knob": 7, "model": "m"})  # AsyncOmni kwargs
    assert resolved.knob == 7 and resolved.sources["prompt_embed_cache_knob"].endswith("prompt_embed_cache_knob")
    assert "prompt_embed_cache_knob" not in kept  # not handed to vLLM-Omni, which would refuse it
    assert resolve_prompt_embed_cache_settings(knob="5", environ={}).knob == 5
    assert resolve_prompt_embed_cache_settings(knob="5", environ={"OMNI_KNOB": "8"}).knob == 8  # the env var wins
    with pytest.raises(PromptEmbedCacheConfigError, match=r"prompt_embed_cache_knob='0' from environment.*1-9"):
        resolve_prompt_embed_cache_settings(environ={"OMNI_KNOB": "0"})
    parser = argparse.ArgumentParser()
    add_prompt_cache_arguments(parser)
    assert vars(parser.parse_args(["--prompt-embed-cache-knob", "4"]))["prompt_embed_cache_knob"] == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--prompt-embed-cache-knob", "abc"])
    assert (
        "| `prompt_embed_cache_knob` | `knob` | `--prompt-embed-cache-knob K` | `OMNI_KNOB` | 1-9 | 3 |"
        in settings_table()
    )
    travelled = PromptEmbedCacheSettings.from_dict(resolved.as_dict(), "a stage config")
    assert travelled.knob == 7 and travelled == resolved
    assert resolved.replace(knob=9).knob == 9


def test_settings_given_in_code_only_do_not_travel() -> None:
    settings = PromptEmbedCacheSettings(enabled=True, digest=lambda buffer: b"0" * 16)
    assert "digest" not in {setting.field for setting in carried_settings()}
    with pytest.raises(PromptEmbedCacheConfigError, match="digest is given in code only"):
        settings.as_dict()
    with pytest.raises(PromptEmbedCacheConfigError, match="invalid digest=3 from keyword argument"):
        PromptEmbedCacheSettings(digest=3)
    with pytest.raises(TypeError, match="unknown prompt-embed cache setting"):
        PromptEmbedCacheSettings(max_sise=3)


def test_the_settings_object_pickles_and_copies_as_it_holds(tmp_path) -> None:
    import copy
    import pickle

    settings = resolve_prompt_embed_cache_settings(enable=True, max_bytes="512MiB", directory=tmp_path, environ={})
    for copied in (pickle.loads(pickle.dumps(settings)), copy.copy(settings), copy.deepcopy(settings)):
        assert copied == settings and copied is not settings and copied.max_bytes == 512 * 2**20
    assert copied.replace(max_bytes=None).max_bytes is None and settings.max_bytes == 512 * 2**20


def test_install_refuses_a_resolved_size_its_keyword_would_override_and_reads_the_signing_key(tmp_path) -> None:
    from vllm_omni_prompt_cache import install_prompt_embed_cache
    from vllm_omni_prompt_cache.calls.wrapper import _for_install
    from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

    resolved = resolve_prompt_embed_cache_settings(enable=True, max_size=64, environ={})
    with pytest.raises(PromptEmbedCacheConfigError, match="prompt_embed_cache_size=64 from keyword argument"):
        install_prompt_embed_cache(TokenIdTextPipeline(build_qwen2_encoder()), settings=resolved)
    assert (
        install_prompt_embed_cache(TokenIdTextPipeline(build_qwen2_encoder()), max_size=64, settings=resolved).max_size
        == 64
    )
    key_file = tmp_path / "key"
    key_file.write_bytes(b"k" * 32)
    key_file.chmod(0o600)
    signed = PromptEmbedCacheSettings(directory=tmp_path / "dir", directory_key_file=str(key_file))
    assert _for_install(signed, 32, True).directory_key == b"k" * 32
    assert _for_install(PromptEmbedCacheSettings(directory=tmp_path / "dir"), 32, True).directory_key is None
