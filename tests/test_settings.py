"""Settings through vLLM-Omni's own config builder and serve parser, with the plugin loaded."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm_omni", reason="the settings tests need the vllm-omni extra")

from vllm_omni.config.config_factory import StageConfigFactory
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.entrypoints.cli.serve import OmniServeCommand
from vllm_omni.utils.tracking_parser import TrackingArgumentParser

from vllm_omni_prompt_cache.settings.schema import BACKEND, MAX_BYTES, MAX_SIZE, VERIFY, PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image
from vllm_omni_prompt_cache.vllm_omni import hook_points
from vllm_omni_prompt_cache.vllm_omni.cli_args import GROUP_TITLE
from vllm_omni_prompt_cache.vllm_omni.settings import RESOLVED_KEY, stage_settings


@pytest.fixture(scope="module")
def model() -> str:
    return str(ensure_tiny_qwen_image())


@pytest.fixture(autouse=True)
def no_cache_env(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("OMNI_DIFFUSION_PROMPT_EMBED_CACHE"):
            monkeypatch.delenv(name)


def default_stage(kwargs: dict) -> dict:
    """The generic diffusion stage as this release's engine builds it from AsyncOmni kwargs."""
    if hook_points.found_choice(hook_points.KWARGS_BUILDER).module == hook_points.ASYNC_ENGINE:  # 0.27, 0.28
        from vllm_omni.engine.async_omni_engine import AsyncOmniEngine

        (stage,) = AsyncOmniEngine._create_default_diffusion_stage_cfg(kwargs)
    else:
        (stage,) = StageConfigFactory.create_default_diffusion(kwargs)
    return stage


def diffusion_config(kwargs: dict) -> OmniDiffusionConfig:
    """What vLLM-Omni builds for the diffusion stage from AsyncOmni kwargs (its own functions)."""
    stage = default_stage(kwargs)
    engine_args = {key: value for key, value in stage["engine_args"].items() if key != "model_stage"}
    return OmniDiffusionConfig.from_kwargs(**engine_args)


@pytest.mark.release
def test_kwargs_reach_the_diffusion_stage_config(model) -> None:
    config = diffusion_config(
        {
            "model": model,
            "enable_prompt_embed_cache": True,
            "prompt_embed_cache_size": 64,
            "prompt_embed_cache_max_bytes": "256MiB",
            "prompt_embed_cache_verify": False,
        }
    )
    assert (config.enable_prompt_embed_cache, config.prompt_embed_cache_size) == (True, 64)
    settings = stage_settings(config)
    assert (settings.enabled, settings.max_size, settings.max_bytes, settings.verify) == (True, 64, 256 * 2**20, False)
    assert settings.backend == "content-keyed"
    assert settings.sources[MAX_BYTES.name] == f"AsyncOmni/Omni keyword argument {MAX_BYTES.name}"


@pytest.mark.release
def test_upstream_kwargs_alone_still_work(model) -> None:
    config = diffusion_config({"model": model, "enable_prompt_embed_cache": True, "prompt_embed_cache_size": 8})
    settings = stage_settings(config)
    assert (settings.enabled, settings.max_size, settings.max_bytes, settings.verify) == (True, 8, None, True)


@pytest.mark.release
def test_settings_are_resolved_once_in_the_callers_process_and_carried_whole(model, monkeypatch) -> None:
    monkeypatch.setenv(MAX_BYTES.env, "2KiB")
    config = diffusion_config({"model": model, "prompt_embed_cache_max_bytes": 1000})
    carried = config.extras[RESOLVED_KEY]
    assert carried[MAX_BYTES.name] == 2048  # the env var won, at construction
    assert carried["sources"][MAX_BYTES.name] == f"environment variable {MAX_BYTES.env}"
    monkeypatch.setenv(MAX_BYTES.env, "4KiB")  # the worker does not resolve again
    assert stage_settings(config).max_bytes == 2048


@pytest.mark.release
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"prompt_embed_cache_size": 0}, "prompt_embed_cache_size=0"),
        ({"prompt_embed_cache_size": -1}, "prompt_embed_cache_size=-1"),
        ({"prompt_embed_cache_max_bytes": "abc"}, "prompt_embed_cache_max_bytes='abc'"),
        ({"prompt_embed_cache_verify": "maybe"}, "prompt_embed_cache_verify='maybe'"),
        ({"enable_prompt_embed_cache": "maybe"}, "enable_prompt_embed_cache='maybe'"),
        ({"prompt_embed_cache_backend": "fast"}, "prompt_embed_cache_backend='fast'"),
    ],
)
def test_bad_kwargs_fail_at_construction_naming_setting_and_source(model, kwargs, named) -> None:
    with pytest.raises(PromptEmbedCacheConfigError, match="from AsyncOmni/Omni keyword argument") as raised:
        default_stage({"model": model, **kwargs})
    assert named in str(raised.value)


@pytest.mark.release
def test_bad_env_var_fails_at_construction(model, monkeypatch) -> None:
    monkeypatch.setenv(MAX_SIZE.env, "abc")
    with pytest.raises(PromptEmbedCacheConfigError, match=f"from environment variable {MAX_SIZE.env}"):
        default_stage({"model": model, "enable_prompt_embed_cache": True})


#: The row-layout setting was removed: rows are cut where a batched call reaches the text encoder.
ROW_LAYOUTS_KWARG = "prompt_embed_cache_row_layouts"
ROW_LAYOUTS_ENV = "OMNI_DIFFUSION_PROMPT_EMBED_CACHE_ROW_LAYOUTS"


@pytest.mark.release
def test_the_removed_row_layouts_kwarg_fails_at_construction_naming_it(model) -> None:
    """Refused by name, not dropped without a word (vLLM-Omni 0.27 and 0.28 drop kwargs they do not know)."""
    with pytest.raises(PromptEmbedCacheConfigError, match=f"AsyncOmni/Omni keyword argument {ROW_LAYOUTS_KWARG}"):
        default_stage({"model": model, "enable_prompt_embed_cache": True, ROW_LAYOUTS_KWARG: "pkg.mod.A=token-ids"})


@pytest.mark.release
def test_the_removed_row_layouts_env_var_fails_at_construction_naming_it(model, monkeypatch) -> None:
    monkeypatch.setenv(ROW_LAYOUTS_ENV, "pkg.mod.A=token-ids")
    with pytest.raises(PromptEmbedCacheConfigError, match=f"environment variable {ROW_LAYOUTS_ENV}"):
        default_stage({"model": model, "enable_prompt_embed_cache": True})


def serve_parser() -> TrackingArgumentParser:
    """vLLM-Omni's real serve parser, built the way its CLI main builds it."""
    parser = TrackingArgumentParser(prog="vllm-omni")
    OmniServeCommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


def test_serve_flags_reach_the_same_config_as_kwargs(model) -> None:
    args = serve_parser().parse_args(
        [
            "serve",
            model,
            "--omni",
            "--enable-prompt-embed-cache",
            "--prompt-embed-cache-size",
            "64",
            "--prompt-embed-cache-max-bytes",
            "256MiB",
            "--no-prompt-embed-cache-verify",
        ]
    )
    kwargs = args.get_explicit_kwargs_dict()  # what the serve command hands to AsyncOmni
    from_flags = diffusion_config({**kwargs, "model": model})
    from_kwargs = diffusion_config(
        {
            "model": model,
            "enable_prompt_embed_cache": True,
            "prompt_embed_cache_size": 64,
            "prompt_embed_cache_max_bytes": "256MiB",
            "prompt_embed_cache_verify": False,
        }
    )
    for field in ("enable_prompt_embed_cache", "prompt_embed_cache_size", "extras"):
        assert getattr(from_flags, field) == getattr(from_kwargs, field)


def test_unset_flags_leave_the_config_alone(model) -> None:
    kwargs = serve_parser().parse_args(["serve", model, "--omni"]).get_explicit_kwargs_dict()
    assert not any("prompt_embed_cache" in key for key in kwargs)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--prompt-embed-cache-size", "0"),
        ("--prompt-embed-cache-size", "-1"),
        ("--prompt-embed-cache-size", "abc"),
        ("--prompt-embed-cache-max-bytes", "0"),
        ("--prompt-embed-cache-max-bytes", "lots"),
        ("--prompt-embed-cache-backend", "fast"),
    ],
)
def test_bad_flag_values_are_argparse_errors(model, capsys, flag, value) -> None:
    with pytest.raises(SystemExit) as exited:
        serve_parser().parse_args(["serve", model, "--omni", flag, value])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {flag}" in error
    assert f"from command-line flag {flag}" in error


#: ``vllm``'s console script runs ``main()`` of this module; here it runs once for each command line,
#: in one fresh interpreter (its entry points loaded as a user's are), each run's output apart.
CONSOLE_SCRIPT = """
import contextlib, io, json, sys
from vllm.entrypoints.cli.main import main
runs = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["vllm", *argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code
    runs.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(runs))
"""


@dataclasses.dataclass
class Command:
    """One run of the console script's ``main()``: how it exited and what it printed."""

    code: int | str | None  # the exit status
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def commands(model) -> dict[str, Command]:
    """``vllm serve --omni --help=TITLE`` and ``vllm serve TINY --omni`` with a bad flag, as a user runs them."""
    command_lines = {
        "help": ["serve", "--omni", f"--help={GROUP_TITLE}"],
        "bad flag": ["serve", model, "--omni", "--prompt-embed-cache-size", "0"],
    }
    result = subprocess.run(
        [sys.executable, "-c", CONSOLE_SCRIPT, json.dumps(list(command_lines.values()))],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    return {name: Command(**run) for name, run in zip(command_lines, runs, strict=True)}


def test_help_lists_the_flags_under_a_titled_group(commands) -> None:
    help_run = commands["help"]
    assert help_run.code == 0, help_run.stderr[-3000:]
    help_text = help_run.stdout  # vLLM prints one section when asked for it by its title
    assert "Default: 32." in " ".join(help_text.split())
    for flag in ("--enable-prompt-embed-cache", "--prompt-embed-cache-size", MAX_BYTES.flag, VERIFY.flag, BACKEND.flag):
        assert flag in help_text


def test_a_bad_flag_is_refused_with_its_name_and_the_allowed_values(commands) -> None:
    refused = commands["bad flag"]
    assert refused.code == 2, refused.stderr[-3000:]  # argparse's usage error: nothing started
    assert "argument --prompt-embed-cache-size" in refused.stderr
    assert "command-line flag --prompt-embed-cache-size" in refused.stderr and "an integer >= 1" in refused.stderr


def test_upstreams_refusal_of_dp_with_text_encoder_allgather_is_kept(model) -> None:
    """Rank-local hits would skip different encoder all-gathers across data-parallel ranks."""
    with pytest.raises(ValueError, match="Prompt embedding cache cannot be combined with text_encoder AllGather"):
        diffusion_config(
            {
                "model": model,
                "enable_prompt_embed_cache": True,
                "data_parallel_size": 2,
                "diffusion_offload_config": {
                    "mode": "layer",
                    "components": ["text_encoder"],
                    "layer_options": {"text_encoder": {"weight_transfer": "allgather"}},
                },
            }
        )
