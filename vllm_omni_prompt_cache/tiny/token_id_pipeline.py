"""A token-ID Qwen-Image pipeline: our stand-in for an RL rollout adapter inside vLLM-Omni.

verl-omni's Qwen-Image rollout adapter receives requests that carry pre-tokenized prompts
(``prompt_ids`` / ``prompt_token_ids``, optionally ``prompt_mask``, and ``negative_prompt_ids``),
collates them into an int64 ``[B, L]`` tensor and a bool ``[B, L]`` mask on the worker's device, and
calls a token-ID ``encode_prompt(prompt_ids, attention_mask, ...)``. This subclass of vLLM-Omni's
``QwenImagePipeline`` does exactly that, then denoises and decodes as the stock pipeline does.
Load it with ``custom_pipeline_args={"pipeline_class": PIPELINE_CLASS}``. It serves both of
vLLM-Omni's execution modes: the request batch (``forward``) and step execution
(``step_execution=True``: ``prepare_encode`` per request, then the stock denoise steps).

Every request collates *fresh* tensors, so with stock vLLM-Omni every ``encode_prompt`` call
bypasses the prompt-embed cache; with this package installed, siblings hit.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, ClassVar

import torch
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline
from vllm_omni.diffusion.models.qwen_image.rope_utils import txt_seq_lens_from_embeds
from vllm_omni.diffusion.utils.size_utils import normalize_min_aligned_size
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch, split_diffusion_output_by_request
from vllm_omni.diffusion.worker.utils import StepRequestState
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns

PIPELINE_CLASS = "vllm_omni_prompt_cache.tiny.token_id_pipeline.TokenIdQwenImagePipeline"

_ID_KEYS = {"prompt": ("prompt_ids", "prompt_token_ids"), "negative_prompt": ("negative_prompt_ids",)}
_MASK_KEYS = {"prompt": "prompt_mask", "negative_prompt": "negative_prompt_mask"}


@dataclasses.dataclass
class _PreparedGeneration:
    """What both execution modes need before denoising: encoded prompts, start latents, schedule."""

    height: int
    width: int
    true_cfg_scale: float
    do_true_cfg: bool
    prompt_embeds: torch.Tensor
    prompt_embeds_mask: torch.Tensor
    negative_embeds: torch.Tensor | None
    negative_mask: torch.Tensor | None
    latents: torch.Tensor
    img_shapes: list[list[tuple[int, int, int]]]
    timesteps: torch.Tensor
    guidance: torch.Tensor | None
    txt_seq_lens: list[int]
    negative_txt_seq_lens: list[int] | None


def _images_per_prompt(sampling: OmniDiffusionSamplingParams) -> int:
    return sampling.num_outputs_per_prompt if sampling.num_outputs_per_prompt > 0 else 1


class TokenIdQwenImagePipeline(CountsEncoderRuns, QwenImagePipeline):
    """Qwen-Image that encodes pre-tokenized prompts (template already applied by the client)."""

    # prepare_encode below replaces the stock one, which calls encode_prompt with the text signature.
    supports_step_execution: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_progress_bar_config(disable=True)  # one bar per request is noise in a rollout
        self.count_encoder_calls(self.text_encoder)  # runs and rows that reached it, timed (a hit reaches nothing)

    def encode_prompt(
        self,
        prompt_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_images_per_prompt: int = 1,
        max_sequence_length: int = 1024,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(prompt_embeds, prompt_embeds_mask)`` for int64 ids and a bool mask ``[B, L]``."""
        embeds, embeds_mask = self.embed_token_ids(prompt_ids, attention_mask)
        embeds, embeds_mask = embeds[:, :max_sequence_length], embeds_mask[:, :max_sequence_length]
        # Same row order for embeddings and mask: prompt 0's copies first, then prompt 1's.
        return (
            embeds.repeat_interleave(num_images_per_prompt, dim=0),
            embeds_mask.repeat_interleave(num_images_per_prompt, dim=0),
        )

    def embed_token_ids(
        self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the text encoder on ``[B, L]`` ids; return each row's attended states after the template
        prefix, right-padded with zeros to the longest row, and their long mask."""
        mask = attention_mask.to(torch.long)
        outputs = self.text_encoder(input_ids=prompt_ids, attention_mask=mask, output_hidden_states=True)
        per_prompt = self._extract_masked_hidden(outputs.hidden_states[-1], mask)
        per_prompt = [hidden[self.prompt_template_encode_start_idx :] for hidden in per_prompt]
        longest = max(hidden.size(0) for hidden in per_prompt)
        embeds = torch.stack([torch.cat([h, h.new_zeros(longest - h.size(0), h.size(1))]) for h in per_prompt])
        embeds_mask = torch.zeros((len(per_prompt), longest), dtype=torch.long, device=embeds.device)
        for index, hidden in enumerate(per_prompt):
            embeds_mask[index, : hidden.size(0)] = 1
        return embeds.to(self.text_encoder.dtype), embeds_mask

    def encode_request_prompts(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        images_per_prompt: int,
        max_sequence_length: int,
        *,
        one_request: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Call ``encode_prompt`` for collated ids and mask, the way this adapter calls it.

        ``one_request``: step execution's per-request call. Subclasses that mirror another
        adapter's call pattern override this.
        """
        return self.encode_prompt(
            ids, mask, num_images_per_prompt=images_per_prompt, max_sequence_length=max_sequence_length
        )

    def collate_token_ids(self, prompts: list[Any], kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Return fresh right-padded int64 ids and a bool mask on this worker's device, or None."""
        rows: list[list[int]] = []
        masks: list[Any] = []
        for prompt in prompts:
            ids = next((prompt[key] for key in _ID_KEYS[kind] if isinstance(prompt, dict) and key in prompt), None)
            if ids is None:
                ids = self._tokenize_text(prompt, kind)
            if ids is None:
                return None
            if ids and isinstance(ids[0], list):  # one request carries one prompt
                (ids,) = ids
            rows.append([int(token) for token in ids])
            masks.append(prompt.get(_MASK_KEYS[kind]))
        pad_id = self.tokenizer.pad_token_id or 0
        length = max(len(row) for row in rows)
        ids_tensor = torch.full((len(rows), length), pad_id, dtype=torch.int64)
        mask_tensor = torch.zeros((len(rows), length), dtype=torch.int64)
        for index, (row, given_mask) in enumerate(zip(rows, masks, strict=True)):
            ids_tensor[index, : len(row)] = torch.tensor(row, dtype=torch.int64)
            if given_mask is None:
                mask_tensor[index, : len(row)] = 1
            else:
                mask_tensor[index, : len(row)] = torch.as_tensor(given_mask).reshape(-1)[: len(row)].to(torch.int64)
        return ids_tensor.to(self.device), (mask_tensor != 0).to(self.device)

    def _tokenize_text(self, prompt: Any, kind: str) -> list[int] | None:
        """Token ids for a request that carries text instead (the engine's warm-up request does)."""
        text = prompt if isinstance(prompt, str) and kind == "prompt" else None
        if isinstance(prompt, dict):
            text = prompt.get(kind)
        if text is None:
            return None
        templated = self.prompt_template_encode.format(text)
        return self.tokenizer(templated, add_special_tokens=False)["input_ids"]

    def _prepare_generation(
        self,
        prompts: list[Any],
        sampling: OmniDiffusionSamplingParams,
        generator: torch.Generator | list[torch.Generator] | None,
        latents: torch.Tensor | None,
        attention_kwargs: dict[str, Any] | None = None,
        *,
        one_request: bool = False,
    ) -> _PreparedGeneration:
        """Encode ``prompts`` (one row each) and draw start latents: the one path both modes share."""
        height = sampling.height or self.default_sample_size * self.vae_scale_factor
        width = sampling.width or self.default_sample_size * self.vae_scale_factor
        height, width = normalize_min_aligned_size(height, width, self.vae_scale_factor * 2)
        images_per_prompt = _images_per_prompt(sampling)
        max_sequence_length = sampling.max_sequence_length or self.tokenizer_max_length
        true_cfg_scale = sampling.true_cfg_scale or 4.0

        positive = self.collate_token_ids(prompts, "prompt")
        if positive is None:
            raise ValueError(
                "TokenIdQwenImagePipeline needs every request to carry 'prompt_ids', 'prompt_token_ids' or 'prompt'"
            )
        prompt_embeds, prompt_embeds_mask = self.encode_request_prompts(
            *positive, images_per_prompt, max_sequence_length, one_request=one_request
        )
        negative = self.collate_token_ids(prompts, "negative_prompt")
        do_true_cfg = true_cfg_scale > 1 and negative is not None
        self.check_cfg_parallel_validity(true_cfg_scale, negative is not None)
        negative_embeds = negative_mask = None
        if do_true_cfg:
            negative_embeds, negative_mask = self.encode_request_prompts(
                *negative, images_per_prompt, max_sequence_length, one_request=one_request
            )

        self._guidance_scale = sampling.guidance_scale if sampling.guidance_scale_provided else 1.0
        self._attention_kwargs = attention_kwargs or {}
        self._current_timestep = None
        self._interrupt = False
        batch_size = len(prompts)
        latents = self.prepare_latents(
            batch_size * images_per_prompt,
            self.transformer.in_channels // 4,
            height,
            width,
            prompt_embeds.dtype,
            self.device,
            generator,
            latents,
        )
        img_shapes = [[(1, height // self.vae_scale_factor // 2, width // self.vae_scale_factor // 2)]] * batch_size
        timesteps, _ = self.prepare_timesteps(sampling.num_inference_steps or 50, sampling.sigmas, latents.shape[1])
        self._num_timesteps = len(timesteps)
        guidance = None
        if self.transformer.guidance_embeds:
            guidance = torch.full([1], self._guidance_scale, dtype=torch.float32).expand(latents.shape[0])
        return _PreparedGeneration(
            height=height,
            width=width,
            true_cfg_scale=true_cfg_scale,
            do_true_cfg=do_true_cfg,
            prompt_embeds=prompt_embeds,
            prompt_embeds_mask=prompt_embeds_mask,
            negative_embeds=negative_embeds,
            negative_mask=negative_mask,
            latents=latents,
            img_shapes=img_shapes,
            timesteps=timesteps,
            guidance=guidance,
            txt_seq_lens=txt_seq_lens_from_embeds(prompt_embeds),
            negative_txt_seq_lens=txt_seq_lens_from_embeds(negative_embeds),
        )

    def forward(self, req: DiffusionRequestBatch) -> list[DiffusionOutput]:
        sampling = req.sampling_params_list[0]
        images_per_prompt = _images_per_prompt(sampling)
        prepared = self._prepare_generation(
            req.prompts,
            sampling,
            req.collate_request_generators(images_per_prompt, None),
            req.collate_request_tensors("latents", None),
        )
        latents = self.diffuse(
            prepared.prompt_embeds,
            prepared.prompt_embeds_mask,
            prepared.negative_embeds,
            prepared.negative_mask,
            prepared.latents,
            prepared.img_shapes,
            prepared.txt_seq_lens,
            prepared.negative_txt_seq_lens,
            prepared.timesteps,
            prepared.do_true_cfg,
            prepared.guidance,
            prepared.true_cfg_scale,
            image_latents=None,
            cfg_normalize=True,
            additional_transformer_kwargs={"return_dict": False, "attention_kwargs": self.attention_kwargs},
        )
        self._current_timestep = None
        result = self._decode_latents(latents, prepared.height, prepared.width, sampling.output_type or "pil")
        outputs = split_diffusion_output_by_request(result, req, num_outputs_per_prompt=images_per_prompt)
        # RL trainers need the final latents (log-probs, exactness checks); the split drops them.
        for index, (output, params) in enumerate(zip(outputs, req.sampling_params_list, strict=True)):
            if params.return_trajectory_latents:
                rows = slice(index * images_per_prompt, (index + 1) * images_per_prompt)
                output.trajectory_latents = latents[rows].detach().clone()
        return outputs

    def prepare_encode(self, state: StepRequestState, **kwargs: Any) -> StepRequestState:
        """Fill ``state`` for step execution; the request's ids take forward's encode path."""
        sampling = state.sampling
        prepared = self._prepare_generation(
            [state.prompt],
            sampling,
            sampling.generator,
            sampling.latents,
            kwargs.get("attention_kwargs"),
            one_request=True,
        )
        # post_decode unpacks at sampling's size: give it the aligned size the latents were drawn at.
        sampling.height, sampling.width = prepared.height, prepared.width
        # prepare_timesteps left this request's schedule on self.scheduler; the next request resets it.
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_begin_index(0)
        state.prompt_embeds = prepared.prompt_embeds
        state.prompt_embeds_mask = prepared.prompt_embeds_mask
        state.negative_prompt_embeds = prepared.negative_embeds
        state.negative_prompt_embeds_mask = prepared.negative_mask
        state.latents = prepared.latents
        state.timesteps = prepared.timesteps
        state.step_index = 0
        state.scheduler = scheduler
        state.do_true_cfg = prepared.do_true_cfg
        state.guidance = prepared.guidance
        state.img_shapes = prepared.img_shapes
        state.txt_seq_lens = prepared.txt_seq_lens
        state.negative_txt_seq_lens = prepared.negative_txt_seq_lens
        sampling.cfg_normalize = True  # as forward's diffuse(cfg_normalize=True)
        return state

    def post_decode(self, state: StepRequestState, **kwargs: Any) -> DiffusionOutput:
        """Decode as the stock step path does, and keep the final latents as forward does."""
        output = super().post_decode(state, **kwargs)
        if state.sampling.return_trajectory_latents:
            output.trajectory_latents = state.latents.detach().clone()
        return output
