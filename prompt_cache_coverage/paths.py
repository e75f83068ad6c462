"""Which of vLLM-Omni's two stage builders makes a pipeline's diffusion stage, and whether the switch reaches it.

vLLM-Omni picks the builder from the model directory: a directory it matches to its pipeline
registry (``model_index.json``'s ``_class_name`` among others) gets that pipeline and its deploy
config; any other goes through the generic diffusion builder. For each architecture name that
vLLM-Omni's diffusion registry maps to a class, a directory holding only that ``model_index.json``
is resolved the way ``AsyncOmni(model=dir, enable_prompt_embed_cache=True,
prompt_embed_cache_size=7)`` resolves it, in this process, without starting an engine.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

SWITCH = {"enable_prompt_embed_cache": True, "prompt_embed_cache_size": 7}


def architectures(class_name: str) -> list[str]:
    """The architecture names (``model_index.json`` class names) vLLM-Omni builds ``class_name`` for."""
    from vllm_omni.diffusion.registry import _DIFFUSION_MODELS

    return sorted(arch for arch, (_, _, cls) in _DIFFUSION_MODELS.items() if cls == class_name)


def build_path(class_name: str) -> str:
    """Say which builder makes ``class_name``'s stage and whether the cache switch reached it."""
    names = architectures(class_name)
    if not names:
        return "not in vLLM-Omni's diffusion registry"
    said = []
    for arch in names:
        try:
            said.append(f"{arch}: {_resolve(arch)}")
        except Exception as error:  # a registered pipeline that needs more than model_index.json
            said.append(f"{arch}: not resolved ({type(error).__name__}: {str(error)[:80]})")
    return "; ".join(said)


def _resolve(arch: str) -> str:
    from vllm_omni.config.config_factory import StageConfigFactory

    with tempfile.TemporaryDirectory() as directory:
        model = Path(directory) / "model"
        model.mkdir()
        (model / "model_index.json").write_text(json.dumps({"_class_name": arch}))
        registered = StageConfigFactory.get_pipeline_config(model=str(model), trust_remote_code=False)
        builder = "generic (kwargs)" if registered is None else f"registered `{registered.model_type}`"
        stages = _diffusion_stages(model)
    reached = [
        s
        for s in stages
        if s.enable_prompt_embed_cache and s.prompt_embed_cache_size == SWITCH["prompt_embed_cache_size"]
    ]
    return f"{builder}, switch {'reached' if stages and len(reached) == len(stages) else 'LOST'}"


def _diffusion_stages(model: Path) -> list[Any]:
    from vllm_omni.config.omni_config import BaseVllmOmniStageConfig
    from vllm_omni.config.resolver import resolve_omni_config
    from vllm_omni.engine import stage_init_utils
    from vllm_omni.entrypoints.utils import prepare_stage_config_inputs

    inputs = prepare_stage_config_inputs(str(model), dict(SWITCH), trust_remote_code=None)
    resolution = resolve_omni_config(
        inputs.model,
        trust_remote_code=inputs.trust_remote_code,
        deploy_config_path=inputs.deploy_config_path,
        cli_overrides=inputs.kwargs,
        stage_overrides=inputs.stage_overrides,
        strategy_config_path=inputs.strategy_config_path,
    )
    stages = []
    for stage_cfg in resolution.stage_configs:
        metadata = (
            stage_init_utils.extract_stage_metadata_from_omni_stage_config(stage_cfg)
            if isinstance(stage_cfg, BaseVllmOmniStageConfig)
            else stage_init_utils.extract_legacy_stage_metadata(stage_cfg)
        )
        if getattr(metadata, "stage_type", None) == "diffusion":
            stages.append(stage_init_utils.build_diffusion_config(inputs.model, stage_cfg, metadata))
    return stages
