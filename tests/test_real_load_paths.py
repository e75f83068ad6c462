"""vLLM-Omni's own load paths with the plugin loaded: the real runner ``load_model`` and deploy-config loader.

Stand-ins elsewhere imitate these paths; here vLLM-Omni's code runs itself. ``load_model`` is the
real ``DiffusionModelRunner.load_model`` (weights loader included) on a tiny custom pipeline that
has nothing to read from disk, and a deploy-config YAML goes through the resolver and stage builder
an engine uses, without starting one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

pytest.importorskip("vllm_omni", reason="the real load paths need the vllm-omni extra")

from vllm.config import set_current_vllm_config
from vllm_omni.config.omni_config import BaseVllmOmniStageConfig
from vllm_omni.config.resolver import resolve_omni_config
from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.forward_context import set_forward_context
from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config
from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
from vllm_omni.diffusion.worker.utils import StepRequestState
from vllm_omni.engine import stage_init_utils
from vllm_omni.entrypoints.utils import prepare_stage_config_inputs
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

from vllm_omni_prompt_cache import PromptEmbedCache
from vllm_omni_prompt_cache.settings.schema import (
    BACKEND,
    DIRECTORY,
    DIRECTORY_BYTES,
    ENABLE,
    ENCODER_ON_MISS,
    HOST_BYTES,
    MAX_BYTES,
    MAX_SIZE,
    METHODS,
    VERIFY,
    PromptEmbedCacheConfigError,
    carried_settings,
)
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.qwen_image import register_one_stage_pipeline
from vllm_omni_prompt_cache.vllm_omni import plugin
from vllm_omni_prompt_cache.vllm_omni.settings import EXTRAS_KEY, stage_settings

CPU = torch.device("cpu")
#: Stage-config sources as our resolver names them for a deploy-config stage.
STAGE_SOURCE = "diffusion stage config"


@pytest.fixture(autouse=True)
def plugin_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load the plugin as a worker does, with no cache env var of the host leaking into the settings."""
    for name in list(os.environ):
        if name.startswith("OMNI_DIFFUSION_PROMPT_EMBED_CACHE"):
            monkeypatch.delenv(name)
    plugin.register()


# ---------------------------------------------------------------------------------------------
# Tiny pipelines that the real loader can build: no weight sources, no checkpoint-required parameter.
# ---------------------------------------------------------------------------------------------


class TinyTransformer(nn.Linear):
    """A stand-in DiT: the prompt interaction handler reads ``pipeline.transformer.dtype``."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        for parameter in self.parameters():
            # Initialized here, not from a checkpoint: the loader's strict check must not ask for it.
            parameter.is_checkpoint_optional = True

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


class TinyPipeline(CountsEncoderRuns, nn.Module):
    """A custom pipeline the way ``DiffusersPipelineLoader`` builds one: ``cls(od_config=...)``. Its encode
    count is kept outside the instance (``CountsEncoderRuns``): an instrument, not state the encode reads."""

    #: No ``ComponentSource``: the loader has nothing to read from disk.
    weights_sources: ClassVar[tuple[Any, ...]] = ()

    def __init__(self, od_config: OmniDiffusionConfig) -> None:
        super().__init__()
        self.transformer = TinyTransformer()

    @property
    def device(self) -> torch.device:
        return self.transformer.weight.device

    def encode_prompt(
        self,
        prompt: str | list[str],
        negative_prompt: str | None = None,
        do_classifier_free_guidance: bool = True,
        num_videos_per_prompt: int = 1,
        max_sequence_length: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Helios's text signature, as the prompt interaction handler calls it."""
        self.encoder_runs += 1
        return torch.full((num_videos_per_prompt, 3, 4), float(len(prompt)), dtype=dtype), None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return {name for name, _ in weights}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("these tests never generate")


class TinyInteractivePipeline(TinyPipeline):
    """Step execution + ``SupportsInteractionApply``, as Helios has: mid-generation prompt updates."""

    supports_step_execution: ClassVar[bool] = True  # part of the runtime-checked protocol

    def __init__(self, od_config: OmniDiffusionConfig) -> None:
        super().__init__(od_config)
        self._interaction_coordinator: Any = None  # stock load_model hands its coordinator over here

    def peek_chunk_media(self, state: StepRequestState) -> Any:
        raise NotImplementedError

    def apply_interaction_at_chunk_boundary(self, state: StepRequestState) -> None:
        raise NotImplementedError

    def prepare_next_chunk(self, state: StepRequestState) -> None:
        raise NotImplementedError

    def prepare_encode(self, state: StepRequestState, **kwargs: Any) -> StepRequestState:
        raise NotImplementedError

    def denoise_step(self, input_batch: Any, **kwargs: Any) -> torch.Tensor | None:
        raise NotImplementedError

    def step_scheduler(self, state: StepRequestState, noise_pred: torch.Tensor, **kwargs: Any) -> None:
        raise NotImplementedError

    def post_decode(self, state: StepRequestState, **kwargs: Any) -> Any:
        raise NotImplementedError


def qualified_name(cls: type) -> str:
    """The string form ``custom_pipeline_args={"pipeline_class": ...}`` hands the loader."""
    return f"{cls.__module__}.{cls.__qualname__}"


def load_with_real_runner(od_config: OmniDiffusionConfig, pipeline_cls: type) -> DiffusionModelRunner:
    """Build a ``DiffusionModelRunner``; run its real ``load_model`` as ``DiffusionWorker.load_model`` does."""
    vllm_config = create_diffusion_vllm_config(CPU, od_config)  # what DiffusionWorker.init_device builds
    runner = DiffusionModelRunner(vllm_config, od_config, device=CPU)
    with (
        set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config),
        set_current_vllm_config(vllm_config),
    ):
        runner.load_model(load_format="custom_pipeline", custom_pipeline_name=qualified_name(pipeline_cls))
    return runner


# ---------------------------------------------------------------------------------------------
# A. Interaction handlers that the real load_model builds see the cache.
# ---------------------------------------------------------------------------------------------


def test_real_load_model_hands_interaction_handlers_the_cached_encode_prompt() -> None:
    """Stock ``load_model`` builds the prompt handler after its install point; it must still get cache hits.

    A prompt update reaches the handler through the runner's real ``submit_interaction``. The one
    thing put in place by hand is the state of a request already generating: the runner's step
    execution creates it from a scheduler output with a pipeline that denoises, which this is not.
    """
    od_config = OmniDiffusionConfig.from_kwargs(
        model_class_name="HeliosPipeline",  # the interaction registry's key for a prompt handler
        enable_prompt_embed_cache=True,
        extras={EXTRAS_KEY: {MAX_BYTES.name: "1KiB"}},  # only our installer reads this
        streaming_output=True,
        step_execution=True,
        dtype=torch.float32,
    )
    runner = load_with_real_runner(od_config, TinyInteractivePipeline)

    cache = runner.prompt_embed_cache
    assert isinstance(cache, PromptEmbedCache)
    assert cache.stats()["max_bytes"] == 1024  # installed by our wrapper from the stage's settings
    assert runner.pipeline._interaction_coordinator is runner._interaction_coordinator

    runner.state_cache["req-0"] = StepRequestState(
        request_id="req-0", sampling=OmniDiffusionSamplingParams(), prompt_embeds=torch.zeros(1, 3, 4)
    )
    for event_id in ("update-1", "update-2"):
        runner.submit_interaction("req-0", {"event_id": event_id, "event": {"prompt": "a red fox at dusk"}})
    stats = cache.stats()
    assert (runner.pipeline.encoder_runs, stats["hits"], stats["misses"]) == (1, 1, 1)


# ---------------------------------------------------------------------------------------------
# B. Settings under engine_args.extras.prompt_embed_cache in a real deploy-config YAML.
# ---------------------------------------------------------------------------------------------

#: A registry key that no model directory name contains (vLLM-Omni also matches keys against paths).
PIPELINE_KEY = "prompt_cache_real_load_paths_single_stage"


def register_single_stage_pipeline() -> None:
    """A one-stage diffusion pipeline, so a deploy config applies to a model directory without an HF config."""
    register_one_stage_pipeline(PIPELINE_KEY)


def deploy_yaml(extras: str, engine_args: str = "") -> str:
    """A deploy config whose diffusion stage names our settings under ``engine_args.extras``."""
    return (
        f"pipeline: {PIPELINE_KEY}\n"
        "stages:\n"
        "  - stage_id: 0\n"
        "    engine_args:\n"
        f"{engine_args}"
        "      extras:\n"
        f"        {EXTRAS_KEY}:\n"
        f"{extras}"
    )


def diffusion_stage_from_deploy_config(tmp_path: Path, yaml_text: str, **kwargs: Any) -> OmniDiffusionConfig:
    """What a diffusion worker receives for stage 0: vLLM-Omni's resolver and stage builder, no engine."""
    register_single_stage_pipeline()
    model = tmp_path / "model"
    model.mkdir()
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml_text)
    return diffusion_stage_of(model, deploy_config=str(deploy), **kwargs)


def diffusion_stage_of(model: Path, **kwargs: Any) -> OmniDiffusionConfig:
    """The diffusion stage ``AsyncOmni(model=model, **kwargs)`` would build (resolved in this process)."""
    inputs = prepare_stage_config_inputs(str(model), dict(kwargs), trust_remote_code=None)
    resolution = resolve_omni_config(
        inputs.model,
        trust_remote_code=inputs.trust_remote_code,
        deploy_config_path=inputs.deploy_config_path,
        cli_overrides=inputs.kwargs,
        stage_overrides=inputs.stage_overrides,
        strategy_config_path=inputs.strategy_config_path,
    )
    if "deploy_config" in kwargs:  # the YAML was the deploy config used, not a default
        assert resolution.config_path == kwargs["deploy_config"]
    (stage_cfg,) = resolution.stage_configs
    metadata = (  # as the engine's stage runtime projects each stage
        stage_init_utils.extract_stage_metadata_from_omni_stage_config(stage_cfg)
        if isinstance(stage_cfg, BaseVllmOmniStageConfig)
        else stage_init_utils.extract_legacy_stage_metadata(stage_cfg)
    )
    return stage_init_utils.build_diffusion_config(inputs.model, stage_cfg, metadata)


STAGE_ENGINE_ARGS = f"      {ENABLE.name}: true\n      {MAX_SIZE.name}: 5\n      dtype: float32\n"


def test_deploy_config_extras_resolve_in_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deploy-config stage skips the kwargs builder: its fields, its extras and the env resolve in the worker."""
    monkeypatch.setenv(VERIFY.env, "off")
    od_config = diffusion_stage_from_deploy_config(
        tmp_path,
        deploy_yaml(
            f"          {MAX_BYTES.name}: 1KiB\n          {BACKEND.name}: vllm-omni\n"
            f"          {HOST_BYTES.name}: 1MiB\n          {DIRECTORY.name}: {tmp_path / 'tier'}\n",
            engine_args=STAGE_ENGINE_ARGS,
        ),
    )
    settings = stage_settings(od_config)
    assert (settings.enabled, settings.max_size, settings.max_bytes) == (True, 5, 1024)
    assert (settings.verify, settings.backend) == (False, "vllm-omni")
    assert (settings.host_bytes, settings.directory) == (2**20, str(tmp_path / "tier"))
    named = (ENABLE.name, MAX_SIZE.name, MAX_BYTES.name, BACKEND.name, HOST_BYTES.name, DIRECTORY.name)
    assert settings.sources == {
        **{name: f"{STAGE_SOURCE} {name}" for name in named},
        VERIFY.name: f"environment variable {VERIFY.env}",
        METHODS.name: "default",
        DIRECTORY_BYTES.name: "default",
        ENCODER_ON_MISS.name: "default",
        "prompt_embed_cache_dir_key_file": "default",
        "prompt_embed_cache_dir_group": "default",
        "prompt_embed_cache_audit": "default",
        "prompt_embed_cache_find_encodes": "default",
    }


def test_deploy_config_extras_reach_the_cache_the_real_load_model_installs(tmp_path: Path) -> None:
    """The YAML's extras arrive in the cache a worker installs: resolver, stage builder, runner, all real."""
    od_config = diffusion_stage_from_deploy_config(
        tmp_path, deploy_yaml(f"          {MAX_BYTES.name}: 1KiB\n", engine_args=STAGE_ENGINE_ARGS)
    )
    runner = load_with_real_runner(od_config, TinyPipeline)
    cache = runner.prompt_embed_cache
    assert isinstance(cache, PromptEmbedCache)
    assert (cache.max_size, cache.max_bytes) == (5, 1024)
    for _ in range(2):
        runner.pipeline.encode_prompt("a red fox at dusk")
    assert (runner.pipeline.encoder_runs, cache.stats()["hits"]) == (1, 1)


def test_a_typo_in_deploy_config_extras_names_the_key_and_the_allowed_names(tmp_path: Path) -> None:
    """vLLM-Omni carries unknown extras silently; ours must not take a misspelt setting for no setting."""
    od_config = diffusion_stage_from_deploy_config(
        tmp_path, deploy_yaml("          prompt_embed_cache_max_byte: 1KiB\n", engine_args=STAGE_ENGINE_ARGS)
    )
    with pytest.raises(PromptEmbedCacheConfigError, match=r"unknown prompt-embed cache setting\(s\)") as raised:
        stage_settings(od_config)
    message = str(raised.value)
    assert "['prompt_embed_cache_max_byte']" in message
    assert message.endswith(f"expected {', '.join(setting.name for setting in carried_settings())}")


def test_enabling_in_deploy_config_extras_is_refused_with_the_reason(tmp_path: Path) -> None:
    """vLLM-Omni's own checks (data-parallel safety) read the stage's field, so extras must not enable the cache."""
    od_config = diffusion_stage_from_deploy_config(tmp_path, deploy_yaml(f"          {ENABLE.name}: true\n"))
    assert od_config.enable_prompt_embed_cache is False  # what vLLM-Omni itself sees for this stage
    with pytest.raises(PromptEmbedCacheConfigError, match="set them as the stage's own engine_args") as raised:
        stage_settings(od_config)
    assert f"['{ENABLE.name}'] under extras.{EXTRAS_KEY}" in str(raised.value)


# ---------------------------------------------------------------------------------------------
# C. The switches reach pipelines vLLM-Omni builds from a registered pipeline (Wan2.2's WanPipeline).
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def wan_model(tmp_path: Path) -> Path:
    """A model directory vLLM-Omni matches to its registered ``wan2_2_ti2v`` pipeline (by model_index.json)."""
    model = tmp_path / "Wan2.2-tiny"
    model.mkdir()
    (model / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    return model


def test_a_registered_pipeline_is_built_by_the_deploy_path(wan_model: Path) -> None:
    from vllm_omni.config.config_factory import StageConfigFactory

    assert StageConfigFactory.get_pipeline_config(model=str(wan_model), trust_remote_code=False) is not None


def test_the_documented_kwargs_turn_the_cache_on_for_a_registered_pipeline(wan_model: Path) -> None:
    """Before this hook, vLLM-Omni dropped the two kwargs here silently and refused our others."""
    assert diffusion_stage_of(wan_model).enable_prompt_embed_cache is False  # off unless asked
    od_config = diffusion_stage_of(
        wan_model, enable_prompt_embed_cache=True, prompt_embed_cache_size=64, prompt_embed_cache_max_bytes="1KiB"
    )
    assert (od_config.enable_prompt_embed_cache, od_config.prompt_embed_cache_size) == (True, 64)
    settings = stage_settings(od_config)
    assert (settings.enabled, settings.max_size, settings.max_bytes) == (True, 64, 1024)


def test_a_stage_scoped_value_wins_and_the_caller_wins_over_the_deploy_yaml(tmp_path: Path) -> None:
    yaml_text = deploy_yaml(
        f"          {MAX_BYTES.name}: 2KiB\n          {VERIFY.name}: off\n", engine_args=STAGE_ENGINE_ARGS
    )
    od_config = diffusion_stage_from_deploy_config(
        tmp_path, yaml_text, prompt_embed_cache_size=64, stage_0_prompt_embed_cache_size=8, **{MAX_BYTES.name: "1KiB"}
    )
    settings = stage_settings(od_config)
    assert (settings.max_size, settings.max_bytes) == (8, 1024)  # stage-scoped kwarg > kwarg > YAML
    assert settings.verify is False  # the YAML's own extra setting is kept
    (tmp_path / "again").mkdir()
    top_level_only = diffusion_stage_from_deploy_config(tmp_path / "again", yaml_text, prompt_embed_cache_size=64)
    assert stage_settings(top_level_only).max_size == 64  # a top-level kwarg beats the YAML's 5


def test_an_explicit_none_is_not_given(wan_model: Path) -> None:
    """A framework forwarding every setting, unset ones as None, builds as if it had passed none."""
    od_config = diffusion_stage_of(wan_model, enable_prompt_embed_cache=True, **{MAX_BYTES.name: None})
    settings = stage_settings(od_config)
    assert (settings.enabled, settings.max_bytes) == (True, None)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"prompt_embed_cache_size": 0}, "prompt_embed_cache_size"),
        ({"enable_prompt_embed_cache": True, MAX_BYTES.name: "lots"}, MAX_BYTES.name),
        ({"stage_0_prompt_embed_cache_verify": "maybe"}, VERIFY.name),
    ],
)
def test_a_bad_value_fails_when_the_engine_is_constructed(wan_model: Path, kwargs: dict, named: str) -> None:
    with pytest.raises(PromptEmbedCacheConfigError, match="AsyncOmni/Omni keyword argument for diffusion stage 0") as e:
        diffusion_stage_of(wan_model, **kwargs)
    assert named in str(e.value)


def test_cache_settings_for_a_pipeline_without_a_diffusion_stage_are_refused() -> None:
    """Asking an LLM-only pipeline for the cache is an error, not a silent no-op."""
    from vllm_omni_prompt_cache.vllm_omni.settings import scope_to_diffusion_stages

    llm_only = PipelineConfig(
        model_type="llm_only",
        model_arch="AnyLLM",
        stages=(
            StagePipelineConfig(
                stage_id=0, model_stage="thinker", execution_type=StageExecutionType.LLM_AR, final_output=True
            ),
        ),
    )
    # Nothing asked for: one kwargs set passed for every model keeps working (vLLM-Omni ignores these here).
    unasked = {"enable_prompt_embed_cache": False, "prompt_embed_cache_size": 32}
    assert scope_to_diffusion_stages(llm_only, unasked) == {}
    assert scope_to_diffusion_stages(llm_only, {"stage_0_prompt_embed_cache_max_bytes": None}) == {}
    refused = r"not a diffusion stage of 'llm_only' \(diffusion stages: \[\]\)"
    with pytest.raises(PromptEmbedCacheConfigError, match=refused):
        scope_to_diffusion_stages(llm_only, {"enable_prompt_embed_cache": True})
    with pytest.raises(PromptEmbedCacheConfigError, match=r"\['stage_0_prompt_embed_cache_size'\]"):
        scope_to_diffusion_stages(llm_only, {"stage_0_prompt_embed_cache_size": 4})
    with pytest.raises(PromptEmbedCacheConfigError, match=r"\['stage_20_prompt_embed_cache_max_bytes'\]"):
        scope_to_diffusion_stages(llm_only, {"stage_20_prompt_embed_cache_max_bytes": "1KiB"})  # any stage id
