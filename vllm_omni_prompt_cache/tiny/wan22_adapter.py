"""A stand-in of verl-omni's Wan2.2 DanceGRPO rollout adapter, faithful to how it calls ``encode_prompt``.

verl-omni cannot be installed here (see :mod:`.verl_omni_adapters`), so
:class:`DanceGrpoWan22Pipeline` reproduces its Wan2.2 adapter's *encode path* over vLLM-Omni's own
``Wan22Pipeline`` and this package's tiny Wan2.2 (:mod:`.wan22`). Load it with
``custom_pipeline_args={"pipeline_class": WAN22_DANCE_GRPO_PIPELINE}``.

Mirrored, from verl-project/verl-omni (main at a1139ba, August 2026),
``verl_omni/pipelines/wan22_dance_grpo/vllm_omni_rollout_adapter.py``,
``Wan22DanceGRPOPipelineWithLogProb``:

* ``encode_prompt`` (lines 265-320): five parameters ``(prompt_ids, attention_mask=None,
  num_videos_per_prompt=1, prompt_embeds=None, max_sequence_length=512)``. Given ``prompt_embeds``
  it returns them untouched with an all-ones mask. Otherwise 1-D ids and masks become one row, no
  mask means every position is attended, the T5 encoder runs on the ids and mask moved to the
  pipeline's device, each row keeps its first ``min(attended, max_sequence_length)`` states and is
  right-padded with zeros to exactly ``max_sequence_length``, the rows are copied
  ``num_videos_per_prompt`` times each, and the returned mask is all ones ``[B*n,
  max_sequence_length]`` (long): the padding is not masked out.
* ``forward`` (lines 322-681; its encode calls end at 517): one request per forward (more is an
  error); the engine's warm-up request (``{"prompt": "dummy run"}``) returns an empty output
  without encoding anything. It reads ``prompt_token_ids``, ``prompt_mask``, ``negative_prompt_ids`` and
  ``negative_prompt_mask`` from the request dict, turns id lists into 1-D int64 tensors on the
  pipeline's device, and turns an *empty* negative into zeros shaped like the prompt's ids with an
  all-False bool mask (so its key depends on the prompt's length). Guidance is 5.0 unless the
  request sets it; CFG is on when either guidance scale exceeds 1. Then two ``encode_prompt``
  calls, all keywords, ``prompt_embeds=None`` passed explicitly: the prompt, and under CFG the
  negative.

Left out, because the cache never sees it: the SDE scheduler and per-step log-probabilities
(``FlowMatchSDEDiscreteScheduler``, its ``diffuse``, the SDE window and shifted sigmas), the
noise seeded from the prompt ids (``init_same_noise``, ``common.seed_from_prompt_ids``: siblings
here differ by their request seeds), image-to-video conditioning, and the rollout output fields
and post-processing hook. Denoising is the stock ``Wan22Pipeline.diffuse`` with its UniPC
scheduler, decoding is the stock VAE path. The training side
(``wan22_dance_grpo/diffusers_training_adapter.py``, with ``common.py``) never runs inside vLLM-Omni.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.media import (
    DiffusionMediaOutput,
    VideoMediaOutput,
    VideoTensorEncoding,
    VideoTensorLayout,
    VideoTensorSpec,
    VideoValueRange,
)
from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import (
    Wan22Pipeline,
    build_wan_scheduler,
    resolve_wan_flow_shift,
    resolve_wan_sample_solver,
)
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch, split_diffusion_output_by_request

from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns

WAN22_DANCE_GRPO_PIPELINE = "vllm_omni_prompt_cache.tiny.wan22_adapter.DanceGrpoWan22Pipeline"

#: The prompt vLLM-Omni's start-up warm-up request carries (``DiffusionEngine._make_dummy_request``).
WARM_UP_PROMPT = "dummy run"
#: verl-omni's forward defaults, used where the request's sampling parameters leave a value unset.
DEFAULT_GUIDANCE_SCALE = 5.0
DEFAULT_BOUNDARY_RATIO = 0.875


class DanceGrpoWan22Pipeline(CountsEncoderRuns, Wan22Pipeline):
    """Wan2.2 that encodes pre-tokenized prompts as verl-omni's DanceGRPO adapter does (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_progress_bar_config(disable=True)  # one bar per request is noise in a rollout
        self.count_encoder_calls(self.text_encoder)  # runs and rows that reached it, timed (a hit reaches nothing)

    def encode_prompt(  # type: ignore[override]
        self,
        prompt_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        num_videos_per_prompt: int = 1,
        prompt_embeds: torch.Tensor | None = None,
        max_sequence_length: int = 512,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(embeds [B*n, max_sequence_length, D], all-ones mask [B*n, max_sequence_length])``."""
        if prompt_embeds is not None:  # precomputed: no encoder, no copies, as verl-omni does
            return prompt_embeds, torch.ones(prompt_embeds.shape[:2], device=prompt_embeds.device, dtype=torch.long)
        prompt_ids = prompt_ids.unsqueeze(0) if prompt_ids.ndim == 1 else prompt_ids
        if attention_mask is None:
            attention_mask = torch.ones_like(prompt_ids, dtype=torch.long)
        elif attention_mask.ndim == 1:
            attention_mask = attention_mask.unsqueeze(0)
        rows = prompt_ids.shape[0]
        kept = attention_mask.gt(0).sum(dim=1).long().clamp(max=max_sequence_length)
        hidden = self._run_text_encoder(prompt_ids, attention_mask)
        padded = torch.stack(
            [
                torch.cat([row[:length], row.new_zeros(max_sequence_length - length, row.size(1))])
                for row, length in zip(hidden, kept.tolist(), strict=True)
            ]
        )
        embeds = padded.repeat(1, num_videos_per_prompt, 1).view(rows * num_videos_per_prompt, max_sequence_length, -1)
        return embeds, torch.ones(embeds.shape[:2], device=self.device, dtype=torch.long)

    def _run_text_encoder(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Return T5's last hidden states ``[B, L, D]`` in the encoder's dtype on this device."""
        outputs = self.text_encoder(prompt_ids.to(self.device), attention_mask.to(self.device))
        return outputs.last_hidden_state.to(dtype=self.text_encoder.dtype, device=self.device)

    def forward(self, req: DiffusionRequestBatch) -> list[DiffusionOutput]:
        if req.num_reqs > 1:
            raise ValueError(f"{type(self).__name__} serves one request per forward, got {req.num_reqs}")
        request = req.prompts[0] if isinstance(req.prompts[0], dict) else {}
        if request.get("prompt") == WARM_UP_PROMPT:
            return [DiffusionOutput(output=None)]
        sampling = req.sampling_params_list[0]
        device = self.device

        prompt_ids = _as_id_tensor(request.get("prompt_token_ids"), device)
        if prompt_ids is None:
            raise ValueError(f"{type(self).__name__} needs a request dict with 'prompt_token_ids'")
        prompt_mask = request.get("prompt_mask")
        negative_ids = _as_id_tensor(request.get("negative_prompt_ids"), device)
        negative_mask = request.get("negative_prompt_mask")
        if negative_ids is not None and negative_ids.numel() == 0:  # "no negative": zeros, nothing attended
            negative_ids = torch.zeros_like(prompt_ids, device=device, dtype=torch.long)
            negative_mask = torch.zeros_like(negative_ids, device=device, dtype=torch.bool)

        guidance_low = sampling.guidance_scale if sampling.guidance_scale_provided else DEFAULT_GUIDANCE_SCALE
        guidance_high = sampling.guidance_scale_2 if sampling.guidance_scale_2 is not None else guidance_low
        self._guidance_scale, self._guidance_scale_2 = guidance_low, guidance_high
        videos_per_prompt = sampling.num_outputs_per_prompt or 1
        max_sequence_length = sampling.max_sequence_length or 512

        prompt_embeds, _ = self.encode_prompt(
            prompt_ids=prompt_ids,
            attention_mask=prompt_mask,
            num_videos_per_prompt=videos_per_prompt,
            prompt_embeds=None,
            max_sequence_length=max_sequence_length,
        )
        negative_embeds = None
        if guidance_low > 1.0 or guidance_high > 1.0:
            if negative_ids is None:
                raise ValueError("CFG is on (guidance > 1): the request needs 'negative_prompt_ids' ([] for none)")
            negative_embeds, _ = self.encode_prompt(
                prompt_ids=negative_ids,
                attention_mask=negative_mask,
                num_videos_per_prompt=videos_per_prompt,
                prompt_embeds=None,
                max_sequence_length=max_sequence_length,
            )

        latents = self._denoise(
            req, sampling, prompt_embeds, negative_embeds, (guidance_low, guidance_high), videos_per_prompt
        )
        result = self._decode(latents, sampling.output_type or "np")
        outputs = split_diffusion_output_by_request(result, req, num_outputs_per_prompt=videos_per_prompt)
        if sampling.return_trajectory_latents:  # the final latents: exactness checks compare these
            outputs[0].trajectory_latents = latents.detach().clone()
        return outputs

    def _denoise(
        self,
        req: DiffusionRequestBatch,
        sampling: Any,
        prompt_embeds: torch.Tensor,
        negative_embeds: torch.Tensor | None,
        guidance: tuple[float, float],
        videos_per_prompt: int,
    ) -> torch.Tensor:
        """Draw the start latents and run the stock UniPC loop (``Wan22Pipeline.diffuse``), text to video."""
        device = self.device
        mod_value = self.vae_scale_factor_spatial * self.transformer_config.patch_size[1]
        height = (sampling.height or 480) // mod_value * mod_value
        width = (sampling.width or 832) // mod_value * mod_value
        num_frames = sampling.num_frames or 81
        if num_frames % self.vae_scale_factor_temporal != 1:
            num_frames = num_frames // self.vae_scale_factor_temporal * self.vae_scale_factor_temporal + 1
        num_frames = max(num_frames, 1)

        # As the stock forward: the request may pick the solver and shift; the scheduler is rebuilt then.
        solver = resolve_wan_sample_solver(req.requests[0], default=self._sample_solver)
        flow_shift = resolve_wan_flow_shift(req.requests[0], self.od_config)
        if solver != self._sample_solver or abs(flow_shift - self._flow_shift) > 1e-6:
            self.scheduler = build_wan_scheduler(solver, flow_shift)
            self._sample_solver, self._flow_shift = solver, flow_shift
        if solver == "unipc":
            self.scheduler.set_timesteps(sampling.num_inference_steps or 40, device=device, shift=flow_shift)
        else:
            self.scheduler.set_timesteps(sampling.num_inference_steps or 40, device=device)
        timesteps = self.scheduler.timesteps
        self._num_timesteps = len(timesteps)
        boundary_ratio = self.boundary_ratio if self.boundary_ratio is not None else sampling.boundary_ratio
        boundary_ratio = DEFAULT_BOUNDARY_RATIO if boundary_ratio is None else boundary_ratio

        generator = req.collate_request_generators(videos_per_prompt, None)
        latents = self.prepare_latents(
            batch_size=prompt_embeds.shape[0],
            num_channels_latents=self.transformer_config.in_channels,
            height=height,
            width=width,
            num_frames=num_frames,
            dtype=torch.float32,
            device=device,
            generator=generator,
            latents=req.collate_request_tensors("latents", None),
        )
        latents = self.diffuse(
            latents=latents,
            timesteps=timesteps,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_embeds,
            guidance_low=guidance[0],
            guidance_high=guidance[1],
            boundary_timestep=boundary_ratio * self.scheduler.config.num_train_timesteps,
            dtype=self.transformer.dtype,
            attention_kwargs={},
            generator=generator,
        )
        self._current_timestep = None
        return latents

    def _decode(self, latents: torch.Tensor, output_type: str) -> DiffusionOutput:
        """Return the video ``[B, C, T, H, W]`` in [-1, 1] as typed media (or the latents for ``"latent"``)."""
        if output_type == "latent":
            return DiffusionOutput(output=latents)
        config = self.vae.config
        latents = latents.to(self.vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype
        )
        video = self.vae.decode(latents / inverse_std + mean, return_dict=False)[0]
        spec = VideoTensorSpec(
            layout=VideoTensorLayout.BCTHW,
            encoding=VideoTensorEncoding.NORMALIZED_FLOAT,
            value_range=VideoValueRange.NEGATIVE_ONE_TO_ONE,
        )
        return DiffusionOutput(media=DiffusionMediaOutput(video=VideoMediaOutput(tensor=video, spec=spec)))


def _as_id_tensor(ids: Any, device: torch.device) -> torch.Tensor | None:
    """Return a request's ids as verl-omni passes them on: a list becomes a 1-D int64 tensor on ``device``."""
    if isinstance(ids, list):
        return torch.tensor(ids, device=device, dtype=torch.long)
    return ids
