"""A stand-in of verl-omni's SD3.5 FlowGRPO rollout adapter, faithful to how it encodes prompts.

verl-omni cannot be installed here (see :mod:`.verl_omni_adapters`), so
:class:`StableDiffusion3PipelineWithLogProb` reproduces its SD3 adapter's *encode path* over
vLLM-Omni 0.30's own ``StableDiffusion3Pipeline`` and this package's tiny SD3.5 Medium
(:mod:`.sd3`). Load it with ``custom_pipeline_args={"pipeline_class": SD3_FLOW_GRPO_PIPELINE}``. The
class names are verl-omni's: the cache recognises ``encode_prompt_from_token_ids`` by the name of
the class that defines it (:mod:`vllm_omni_prompt_cache.calls.methods`).

Mirrored, from verl-project/verl-omni (main at a1139baf):

* ``verl_omni/pipelines/sd3_flow_grpo/common.py`` lines 32-138: ``SD3TokenIdPromptMixin``.
  ``encode_prompt_from_token_ids(clip_prompt_ids, t5_prompt_ids, num_images_per_prompt=1,
  max_sequence_length=256)`` takes ``list[list[int]]``, one unpadded id list per prompt (special
  tokens included). One CLIP id list feeds both CLIP towers: for each, the lists are right-padded
  with that tower's tokenizer's pad id to ``tokenizer_max_length`` (77; longer lists are cut, with a
  warning) into an int64 tensor on the pipeline's device, and the tower runs as
  ``text_encoder(ids, output_hidden_states=True)`` (no mask): the pooled output is ``[0]``, the
  sequence is ``hidden_states[-2]``, both cast to ``od_config.dtype``. T5 pads to
  ``max_sequence_length`` with its own pad id and runs as ``text_encoder_3(ids)[0]``; without a T5
  encoder it is zeros ``[B*n, max_sequence_length, joint_attention_dim]``. Copies are
  ``repeat(1, n, 1).view(B*n, ...)``, as in the text path. Returns ``(prompt_embeds [B*n, 77 +
  max_sequence_length, D_t5], pooled [B*n, D_L + D_G])``: CLIP-L and CLIP-G joined on the feature
  axis, zero-padded to T5's width, then joined with T5 on the sequence axis. CLIP-L, CLIP-G, T5 run
  in that order.
* ``verl_omni/pipelines/sd3_flow_grpo/vllm_omni_rollout_adapter.py``:
  ``_extract_text_prompts`` / ``_to_token_list`` / ``_extract_extra_prompt_ids`` (lines 70-127) and
  ``StableDiffusion3PipelineWithLogProb.forward`` (lines 336-544: its encode calls at 420-459, the
  warm-up's early return at 491-499, decoding and the per-request split at 517-544).
  Several requests share one forward (``supports_request_batch``). Each request dict's
  ``extra_prompt_ids`` ``{"clip": [...], "t5": [...]}`` (lists, or tensors turned into lists) are
  gathered into ``{"clip": [[...], ...], "t5": [[...], ...]}``; if any request lacks them, the batch
  takes the text path instead, from the requests' ``prompt`` fields. ``negative_extra_prompt_ids``
  are read the same way, only when every request has ``extra_prompt_ids``. A batch with neither
  ids nor text: ``prompt_token_ids`` alone are refused (the adapter never decodes ids to text),
  anything else (a warm-up without a prompt) returns empty outputs. Shared settings come
  from the first request's sampling parameters; guidance is 0.0 unless the request sets it, and
  CFG is on when it exceeds 1. Encode calls, all keywords: the prompt through
  ``encode_prompt_from_token_ids(clip_prompt_ids=..., t5_prompt_ids=..., max_sequence_length=...,
  num_images_per_prompt=...)`` (or, for text, ``encode_prompt(prompt=..., prompt_2=None,
  prompt_3=None, max_sequence_length=..., num_images_per_prompt=...)``); under CFG the negative
  through ``encode_prompt_from_token_ids`` when the requests carry negative ids, else through the
  text ``encode_prompt`` with the requests' ``negative_prompt`` texts or, when none has one,
  ``[""] * batch_size``. The engine's warm-up request (``{"prompt": "dummy run"}``, guidance 0.0,
  2 steps at 512x512) therefore encodes "dummy run" through the text path, and is denoised and
  decoded like any request unless its SDE window is empty (a one-step schedule).

Left out, because the cache never sees it: the SDE scheduler and everything it feeds
(``FlowMatchSDEDiscreteScheduler``, per-sample SDE windows, per-step log-probabilities, the
trajectory and prompt-embedding fields of ``rollout_output``, the ``"both"`` output's clean
latents), the latent post-processing hook it installs on ``pipeline_sd3``, its registration with
verl-omni's ``VllmOmniPipelineBase``, and ``forward``'s keyword parameters (defaults for direct
calls; vLLM-Omni passes only the request: here they are the module's ``DEFAULT_*`` constants).
Denoising is the stock ``StableDiffusion3Pipeline.diffuse`` with its flow-match Euler scheduler;
decoding is the stock VAE path. ``trajectory_latents`` here holds each request's *final* latents
(exactness checks compare these). The training side (``sd3_flow_grpo/diffusers_training_adapter.py``)
never runs inside vLLM-Omni.

Counting: a forward pre-hook on ``self.text_encoder`` (CLIP-L, which both the token path and the
text path run once per encode call) counts ``encoder_runs`` and ``encoder_rows``; hooks on all
three encoders add up ``encode_seconds``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline
from vllm_omni.diffusion.request import DUMMY_DIFFUSION_REQUEST_ID, OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch, split_diffusion_output_by_request

from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns

SD3_FLOW_GRPO_PIPELINE = "vllm_omni_prompt_cache.tiny.sd3_adapter.StableDiffusion3PipelineWithLogProb"

#: The request fields verl-omni's agent loop fills, one id list per text-encoder tokenizer
#: (``actor_rollout_ref.model.extra_tokenizers``); CLIP-L's ids feed both CLIP towers.
EXTRA_PROMPT_IDS = "extra_prompt_ids"
NEGATIVE_EXTRA_PROMPT_IDS = "negative_extra_prompt_ids"
CLIP_KEY = "clip"
T5_KEY = "t5"
ENCODER_KEYS = (CLIP_KEY, T5_KEY)
#: verl-omni's forward defaults, used where the request's sampling parameters leave a value unset.
DEFAULT_STEPS = 28
DEFAULT_GUIDANCE_SCALE = 0.0
DEFAULT_MAX_SEQUENCE_LENGTH = 256
DEFAULT_OUTPUT_TYPE = "image"
OUTPUT_TYPES = ("image", "latent", "both")

logger = logging.getLogger(__name__)


class SD3TokenIdPromptMixin:
    """SD3's ``encode_prompt`` for token ids the agent loop produced once (see the module)."""

    def encode_prompt_from_token_ids(
        self,
        clip_prompt_ids: list[list[int]],
        t5_prompt_ids: list[list[int]],
        num_images_per_prompt: int = 1,
        max_sequence_length: int = 256,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(prompt_embeds [B*n, 77 + max_sequence_length, D], pooled [B*n, D_pooled])``."""
        clip_l, pooled_l = self._clip_embeds_from_ids(clip_prompt_ids, num_images_per_prompt, tower=0)
        clip_g, pooled_g = self._clip_embeds_from_ids(clip_prompt_ids, num_images_per_prompt, tower=1)
        t5 = self._t5_embeds_from_ids(t5_prompt_ids, num_images_per_prompt, max_sequence_length)
        clip = torch.cat([clip_l, clip_g], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([pooled_l, pooled_g], dim=-1)

    def _clip_embeds_from_ids(
        self, prompt_ids: list[list[int]], copies: int, tower: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return CLIP tower ``tower``'s penultimate states ``[B*n, 77, D]`` and pooled output ``[B*n, D]``."""
        tokenizer = (self.tokenizer, self.tokenizer_2)[tower]
        encoder = (self.text_encoder, self.text_encoder_2)[tower]
        ids = _padded_ids(prompt_ids, self.tokenizer_max_length, tokenizer.pad_token_id, self.device)
        encoded = encoder(ids, output_hidden_states=True)
        dtype = self.od_config.dtype
        pooled = encoded[0].to(dtype=dtype, device=self.device)
        states = encoded.hidden_states[-2].to(dtype=dtype, device=self.device)
        rows, length, _ = states.shape
        return (
            states.repeat(1, copies, 1).view(rows * copies, length, -1),
            pooled.repeat(1, copies).view(rows * copies, -1),
        )

    def _t5_embeds_from_ids(self, prompt_ids: list[list[int]], copies: int, max_sequence_length: int) -> torch.Tensor:
        """Return T5's states ``[B*n, max_sequence_length, D]`` (zeros when the checkpoint has no T5)."""
        rows = len(prompt_ids)
        dtype = self.od_config.dtype
        if self.text_encoder_3 is None:
            width = self.transformer.joint_attention_dim
            return torch.zeros((rows * copies, max_sequence_length, width), device=self.device, dtype=dtype)
        ids = _padded_ids(prompt_ids, max_sequence_length, self.tokenizer_3.pad_token_id, self.device)
        states = self.text_encoder_3(ids)[0].to(dtype=dtype, device=self.device)
        length = states.shape[1]
        return states.repeat(1, copies, 1).view(rows * copies, length, -1)


class StableDiffusion3PipelineWithLogProb(CountsEncoderRuns, SD3TokenIdPromptMixin, StableDiffusion3Pipeline):
    """SD3.5 that encodes pre-tokenized prompts as verl-omni's FlowGRPO adapter does (see the module)."""

    supports_request_batch = True

    def __init__(self, *, od_config: OmniDiffusionConfig, prefix: str = "") -> None:
        super().__init__(od_config=od_config, prefix=prefix)
        # Runs and rows of CLIP-L (both paths call it once per encode), time of all three encoders.
        self.count_encoder_calls(self.text_encoder, timed=(self.text_encoder_2, self.text_encoder_3))

    def forward(self, req: OmniDiffusionRequest | DiffusionRequestBatch) -> DiffusionOutput | list[DiffusionOutput]:
        batch = req if isinstance(req, DiffusionRequestBatch) else DiffusionRequestBatch(requests=[req])
        requests = batch.prompts or []
        ids = _encoder_ids(requests, EXTRA_PROMPT_IDS)
        negative_ids = _encoder_ids(requests, NEGATIVE_EXTRA_PROMPT_IDS) if ids is not None else None
        prompt, negative_prompt = _text_prompts(requests)

        if ids is None and prompt is None:
            if any(isinstance(r, dict) and r.get("prompt_token_ids") is not None for r in requests):
                raise ValueError(
                    f"{type(self).__name__} needs '{EXTRA_PROMPT_IDS}' with {list(ENCODER_KEYS)} ids per request: "
                    "it does not decode 'prompt_token_ids' back to text"
                )
            empty = [DiffusionOutput(output=None) for _ in range(batch.num_reqs)]
            return _as_returned(empty, req)

        sampling = batch.sampling_params_list[0]
        height = sampling.height or self.default_sample_size * self.vae_scale_factor
        width = sampling.width or self.default_sample_size * self.vae_scale_factor
        steps = sampling.num_inference_steps or DEFAULT_STEPS
        max_sequence_length = sampling.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        guidance_scale = sampling.guidance_scale if sampling.guidance_scale_provided else DEFAULT_GUIDANCE_SCALE
        output_type = _output_type(sampling)
        copies = sampling.num_outputs_per_prompt if sampling.num_outputs_per_prompt > 0 else 1
        for request in batch.requests:  # as verl-omni: a seed without a generator gets one on this device
            params = request.sampling_params
            if params.generator is None and params.seed is not None:
                params.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        generator = batch.collate_request_generators(copies, None)
        latents = batch.collate_request_tensors("latents", None)
        self._guidance_scale = guidance_scale
        self._current_timestep = None
        self._interrupt = False

        batch_size = len(ids[CLIP_KEY]) if ids is not None else len(prompt)
        do_cfg = guidance_scale > 1
        prompt_embeds, pooled = self._encode(ids, prompt, max_sequence_length, copies)
        negative_embeds = negative_pooled = None
        if do_cfg:
            negative_prompt = negative_prompt or [""] * batch_size  # SD3's default negative: the empty prompt
            negative_embeds, negative_pooled = self._encode(negative_ids, negative_prompt, max_sequence_length, copies)

        latents = self.prepare_latents(
            batch_size * copies, self.transformer.in_channels, height, width, generator, latents
        )
        timesteps, _ = self.prepare_timesteps(steps, sampling.sigmas, _image_seq_len(height, width))
        self._num_timesteps = len(timesteps)
        warm_up = batch.requests[0].request_id == DUMMY_DIFFUSION_REQUEST_ID
        if not (warm_up and _sde_window_is_empty(sampling, len(timesteps))):
            latents = self.diffuse(
                latents=latents,
                timesteps=timesteps,
                prompt_embeds=prompt_embeds,
                pooled_prompt_embeds=pooled,
                negative_prompt_embeds=negative_embeds,
                negative_pooled_prompt_embeds=negative_pooled,
                do_true_cfg=do_cfg,
                guidance_scale=guidance_scale,
                cfg_normalize=False,
            )
        self._current_timestep = None
        result = DiffusionOutput(output=self._decode(latents, output_type), to_cpu=True)
        outputs = split_diffusion_output_by_request(result, batch, num_outputs_per_prompt=copies)
        for index, (output, params) in enumerate(zip(outputs, batch.sampling_params_list, strict=True)):
            if params.return_trajectory_latents:  # the final latents: exactness checks compare these
                output.trajectory_latents = latents[index * copies : (index + 1) * copies].detach().clone()
        return _as_returned(outputs, req)

    def _encode(
        self,
        ids: dict[str, list[list[int]]] | None,
        prompt: list[str] | None,
        max_sequence_length: int,
        copies: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the batch's ids when it has them, else its texts, with the keywords verl-omni passes."""
        if ids is not None:
            return self.encode_prompt_from_token_ids(
                clip_prompt_ids=ids[CLIP_KEY],
                t5_prompt_ids=ids[T5_KEY],
                max_sequence_length=max_sequence_length,
                num_images_per_prompt=copies,
            )
        return self.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            prompt_3=None,
            max_sequence_length=max_sequence_length,
            num_images_per_prompt=copies,
        )

    def _decode(self, latents: torch.Tensor, output_type: str) -> torch.Tensor:
        """Return the images ``[B, 3, H, W]`` in [-1, 1] (or the latents for ``"latent"``)."""
        if output_type == "latent":
            return latents
        latents = latents.to(self.vae.dtype) / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return self.vae.decode(latents, return_dict=False)[0]


def _padded_ids(prompt_ids: list[list[int]], length: int, pad_id: int, device: torch.device) -> torch.Tensor:
    """Return the id lists right-padded with ``pad_id`` (or cut) to ``length``, as int64 ``[B, length]``."""
    rows = []
    for ids in prompt_ids:
        row = [int(token) for token in ids]
        if len(row) > length:
            logger.warning("a prompt of %d tokens is cut to the encoder's %d", len(row), length)
            row = row[:length]
        rows.append(row + [pad_id] * (length - len(row)))
    return torch.tensor(rows, dtype=torch.long, device=device)


def _text_prompts(requests: list[Any]) -> tuple[list[str] | None, list[str] | None]:
    """Return the batch's prompt and negative texts; each is None when every request's is empty."""
    if not requests:
        return None, None
    prompt = [r if isinstance(r, str) else (r.get("prompt") or "") for r in requests]
    negative = ["" if isinstance(r, str) else (r.get("negative_prompt") or "") for r in requests]
    return (prompt if any(prompt) else None), (negative if any(negative) else None)


def _encoder_ids(requests: list[Any], field: str) -> dict[str, list[list[int]]] | None:
    """Return ``{encoder: [ids of each request]}`` from ``field``, or None if a request lacks it."""
    found = []
    for request in requests:
        extra = request.get(field) if isinstance(request, dict) else None
        if not extra:
            return None
        found.append(extra)
    if not found:
        return None
    for index, extra in enumerate(found):
        missing = [name for name in ENCODER_KEYS if name not in extra]
        if missing:
            raise ValueError(f"request {index}'s '{field}' lacks {missing}: SD3 needs {list(ENCODER_KEYS)}")
        for name in ENCODER_KEYS:
            if _as_id_list(extra[name]) is None:
                raise ValueError(
                    f"request {index}'s '{field}[{name}]' must be a list or tensor of ids, "
                    f"got {type(extra[name]).__name__}"
                )
    return {name: [_as_id_list(extra[name]) for extra in found] for name in ENCODER_KEYS}


def _as_id_list(value: Any) -> list[int] | None:
    """Return token ids as a list (a tensor's ``tolist()``), or None for anything else."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value if isinstance(value, list) else None


def _output_type(sampling: Any) -> str:
    """Return the request's output type (its field, else ``extra_args``, else "image"), validated."""
    output_type = sampling.output_type
    if output_type is None:
        output_type = sampling.extra_args.get("output_type")
    output_type = DEFAULT_OUTPUT_TYPE if output_type is None else output_type
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"SD3 rollout output_type must be one of {list(OUTPUT_TYPES)}, got {output_type!r}")
    return output_type


def _image_seq_len(height: int, width: int) -> int:
    """Return the transformer's image tokens for a request (SD3's 8x VAE, 2x2 patches)."""
    return (int(height) // 8 // 2) * (int(width) // 8 // 2)


def _sde_window_is_empty(sampling: Any, num_timesteps: int) -> bool:
    """Whether verl-omni's SDE window for this request is empty: no window size means all steps but the last."""
    size = (sampling.extra_args or {}).get("sde_window_size")
    return (num_timesteps - 1 if size is None else int(size)) == 0


def _as_returned(outputs: list[DiffusionOutput], req: Any) -> DiffusionOutput | list[DiffusionOutput]:
    """Return the list for a request batch, the single output for a lone request (as verl-omni)."""
    return outputs if isinstance(req, DiffusionRequestBatch) else outputs[0]
