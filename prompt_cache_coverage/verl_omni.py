"""verl-omni's diffusion rollout adapters, and the encode method each one's ``forward`` calls.

verl-omni cannot be installed here (it pins a verl commit the package index lacks), so its adapters
are listed from its repository: every ``verl_omni/pipelines/*/vllm_omni_rollout_adapter.py`` at
:data:`VERL_OMNI_COMMIT` (``git ls-tree -r --name-only a1139baf verl_omni/pipelines`` in a clone).
``tests/test_verl_omni_adapters.py`` checks that ``docs/verl-omni-adapters.md`` has a row for each,
that the cache recognises each encode method named here (or refuses it, or has nothing to do), and,
given a verl-omni clone (``VERL_OMNI_REPO``), that this list is the commit's own set of adapters.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The verl-omni commit the adapters were read at (main, 2026-08-22).
VERL_OMNI_COMMIT = "a1139baf"


@dataclass(frozen=True)
class Adapter:
    """One rollout adapter: where it lives, and the class and method its forward encodes token IDs through."""

    directory: str  # verl_omni/pipelines/<directory>/vllm_omni_rollout_adapter.py
    name: str
    owner: str | None  # ``__name__`` of the class defining the encode method; None: no separate text encoder
    method: str | None


ADAPTERS: tuple[Adapter, ...] = (
    Adapter("qwen_image_flow_grpo", "Qwen-Image FlowGRPO", "QwenImagePipelineWithLogProb", "encode_prompt"),
    Adapter("qwen_image_mix_grpo", "Qwen-Image MixGRPO", "QwenImagePipelineWithLogProb", "encode_prompt"),
    Adapter("qwen_image_dual_grpo", "Qwen-Image DualGRPO", "QwenImagePipelineWithLogProb", "encode_prompt"),
    Adapter("qwen_image_diffusion_nft", "Qwen-Image DiffusionNFT", "QwenImageTokenIdPromptMixin", "encode_prompt"),
    Adapter("qwen_image_dpo", "Qwen-Image DPO", "QwenImageDPOPipeline", "encode_prompt"),
    Adapter(
        "qwen_image_edit_flow_grpo", "Qwen-Image-Edit FlowGRPO", "QwenImageEditPlusPipelineWithLogProb", "encode_prompt"
    ),
    Adapter("wan22_dance_grpo", "Wan2.2 DanceGRPO", "Wan22DanceGRPOPipelineWithLogProb", "encode_prompt"),
    Adapter("sd3_flow_grpo", "SD3.5 FlowGRPO", "SD3TokenIdPromptMixin", "encode_prompt_from_token_ids"),
    Adapter("ltx2_flow_grpo", "LTX-2.3 FlowGRPO", "LTX23PipelineWithLogProb", "_encode_token_ids"),
    Adapter("minimax_h3_diffusion_nft", "MiniMax-H3 DiffusionNFT", "MiniMaxH3RolloutWeightSyncMixin", "encode_prompt"),
    Adapter("bagel_flow_grpo", "Bagel FlowGRPO", None, None),
)
