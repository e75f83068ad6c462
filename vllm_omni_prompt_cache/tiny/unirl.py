"""UniRL's way of driving vLLM-Omni, as its code does it: the stand-ins our UniRL tests and benchmark run.

Read at Tencent-Hunyuan/UniRL (its search-index versions of ``unirl/rollout/engine/vllm_omni/``); no
code of it is copied here, only its calls, argument types and order:

* :class:`UniRLRollout` mirrors ``backends/native.py`` and ``engine.py``: an in-process, synchronous
  ``Omni(model=..., deploy_config=..., **omni_kwargs)`` whose kwargs are ``settings/schema.py``'s
  ``server_intent`` layering (``stage_init_timeout``, ``init_timeout``, ``mode``, then ``omni_extra``,
  then ``enable_sleep_mode=True`` on top); ``omni.generate(prompts, [OmniDiffusionSamplingParams],
  use_tqdm=False)``; and per step, for every stage, ``omni.engine.collective_rpc(method=
  "handle_sleep_task", args=(OmniSleepTask(level=1, task_id=...),), stage_ids=[sid])`` with its ACK
  check, the trainer's weight sync, then ``handle_wake_task`` with ``OmniWakeTask(tags=None, ...)``.
* :func:`grouped_prompts` and :func:`sampling_kwargs` mirror ``adapters/qwen_image.py``
  (``QwenImageGroupedInputAdapter``): one ``{"prompt", "negative_prompt"}`` dict per group of K
  siblings, collapsed by ``num_outputs_per_prompt=K``, with ``true_cfg_scale`` and an integer seed.
* :class:`UniRLQwenImagePipeline` plays the custom pipeline its Qwen-Image deploy config names
  (``custom_pipeline_args.pipeline_class``): stock ``QwenImagePipeline`` on text prompts, its text
  encoder's runs counted outside the instance.
* :class:`TapAfterCachePipeline` and :class:`TapBeforeCachePipeline` carry the conditioning tap of
  ``pipelines/hv15/pipeline.py`` (``RLHunyuanVideo15Pipeline``): ``self.encode_prompt`` wrapped by a
  closure that stores the request's first encode, as CPU tensors, on ``self._captured_conditioning``
  (reset before each request's forward). HV1.5 installs it at its first ``forward``, after any cache
  was installed; the second class installs it in ``__init__``, before. Its output adapter's
  ``RuntimeError`` when nothing was captured is :func:`conditioning_of`'s.
* :class:`UniRLWorkerExtension` plays ``worker/dit_extension.py``'s ``DiTWeightSyncExtension``: the
  weight sync the trainer pushes after each step (DiT weights; or text-encoder weights, for the case
  that must drop the cache).
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.qwen_image import register_one_stage_pipeline
from vllm_omni_prompt_cache.tiny.worker_extension import TextEncoderCountersExtension

PIPELINE_CLASS = f"{__name__}.UniRLQwenImagePipeline"
TAP_AFTER_CACHE = f"{__name__}.TapAfterCachePipeline"
TAP_BEFORE_CACHE = f"{__name__}.TapBeforeCachePipeline"
WORKER_EXTENSION = f"{__name__}.UniRLWorkerExtension"
#: The key UniRL registers its one-stage image pipelines under is ``unirl_rl_image_diffusion``; ours
#: is a name no model directory contains (vLLM-Omni also matches keys against paths).
PIPELINE_KEY = "prompt_cache_unirl_rl_image_diffusion"
#: What UniRL's ``server_intent`` puts first in ``omni_kwargs``.
BOOT_TIMEOUTS = {"stage_init_timeout": 1200, "init_timeout": 1800}
MISSING_CAPTURE = "rollout returned no 'text_capture' (the conditioning tap did not run in the DiT worker)"


class UniRLQwenImagePipeline(CountsEncoderRuns, QwenImagePipeline):
    """Stock Qwen-Image on text prompts, as UniRL's deploy config loads it, with its encoder runs counted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.set_progress_bar_config(disable=True)
        self.count_encoder_calls(self.text_encoder)


#: What each tapping pipeline captured, request by request: an instrument kept outside the instance.
_CAPTURES: weakref.WeakKeyDictionary[Any, list[dict[str, Any] | None]] = weakref.WeakKeyDictionary()


class _ConditioningTap(UniRLQwenImagePipeline):
    """HV1.5's conditioning tap on Qwen-Image: the first encode of each request lands on ``self``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._captured_conditioning: dict[str, torch.Tensor] | None = None
        self._conditioning_tap_installed = False

    def _install_conditioning_tap(self) -> None:
        if self._conditioning_tap_installed:
            return
        encode = self.encode_prompt  # whatever is there now: the cache's wrapper, if it was installed first

        def tapped(*args: Any, **kwargs: Any) -> Any:
            embeds, mask = encode(*args, **kwargs)
            if self._captured_conditioning is None:  # the request's first encode: its prompt
                self._captured_conditioning = {
                    "prompt_embeds": embeds.detach().to("cpu", copy=True),
                    "prompt_embeds_mask": None if mask is None else mask.detach().to("cpu", copy=True),
                }
            return embeds, mask

        self.encode_prompt = tapped
        self._conditioning_tap_installed = True

    def forward(self, req: Any, *args: Any, **kwargs: Any) -> Any:
        self._install_conditioning_tap()
        self._captured_conditioning = None  # armed for this request
        output = super().forward(req, *args, **kwargs)
        _CAPTURES.setdefault(self, []).append(self._captured_conditioning)
        return output


class TapAfterCachePipeline(_ConditioningTap):
    """The tap as HV1.5 installs it: at the first ``forward``, after the worker installed any cache."""


class TapBeforeCachePipeline(_ConditioningTap):
    """The tap installed in ``__init__``: the cache then wraps the tapped ``encode_prompt``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._install_conditioning_tap()


def digest(tensor: torch.Tensor | None) -> tuple | None:
    """A tensor's dtype, shape and content digest (what a comparison across processes needs)."""
    if tensor is None:
        return None
    data = tensor.detach().cpu().contiguous()
    return (str(data.dtype), tuple(data.shape), xxhash.xxh3_128_hexdigest(data.view(torch.uint8).numpy().tobytes()))


def conditioning_of(captures: Sequence[Mapping[str, tuple | None] | None]) -> list[Mapping[str, tuple | None]]:
    """UniRL's output adapter: every request must carry the conditioning its tap captured."""
    if any(capture is None for capture in captures):
        raise RuntimeError(f"build_response: {MISSING_CAPTURE}")
    return list(captures)


class UniRLWorkerExtension(TextEncoderCountersExtension):
    """The worker side of UniRL's weight sync, and what the tests read back from the worker."""

    def sync_weights(self, component: str, step: int) -> int:
        """Load new weights for ``component`` (``transformer``: the DiT a step trained; ``text_encoder``),
        derived from the current ones by ``step``, through ``pipeline.load_weights`` as a sync does."""
        pipeline = self.model_runner.pipeline
        generator = torch.Generator().manual_seed(step)
        weights = []
        for name, parameter in getattr(pipeline, component).named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32) * 1e-3
            weights.append((f"{component}.{name}", (parameter.detach().float() + noise).to(parameter.dtype)))
        pipeline.load_weights(weights)
        return len(weights)

    def captured_conditioning(self) -> list[dict[str, tuple | None] | None]:
        """Return (and forget) each request's captured conditioning since the last call, as digests."""
        captures = _CAPTURES.pop(self.model_runner.pipeline, [])
        return [
            None if capture is None else {name: digest(tensor) for name, tensor in capture.items()}
            for capture in captures
        ]

    def resolved_cache_settings(self) -> dict[str, Any]:
        """Return the cache settings this worker's stage resolves to (``stage_settings`` of its config)."""
        from vllm_omni_prompt_cache.vllm_omni.settings import stage_settings

        return stage_settings(self.model_runner.od_config).as_dict()

    def clear_cache_before_sleep(self) -> None:
        """UniRL PR #449's clear before the allocator sleeps (its ``DiTWeightSyncExtension.sleep``)."""
        runner = self.model_runner
        if getattr(runner, "clear_prompt_embed_cache", None) is not None:
            runner.clear_prompt_embed_cache()


def grouped_prompts(texts: Sequence[str], negative_prompt: str) -> list[dict[str, str]]:
    """One request prompt per group (``QwenImageGroupedInputAdapter`` with guidance on)."""
    return [{"prompt": text, "negative_prompt": negative_prompt} for text in texts]


def sampling_kwargs(group_size: int, seed: int, *, size: int = 64, steps: int = 2, guidance: float = 4.0) -> dict:
    """``OmniDiffusionSamplingParams`` kwargs as UniRL's Qwen-Image adapter sets them (no SDE extras)."""
    return {
        "height": size,
        "width": size,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "guidance_scale_provided": True,
        "true_cfg_scale": guidance,
        "num_outputs_per_prompt": group_size,
        "seed": seed,
    }


def omni_kwargs(omni_extra: Mapping[str, Any], *, mode: str | None = None, sleep_mode: bool = True) -> dict:
    """``server_intent``'s ``omni_kwargs``: timeouts, ``mode``, then ``omni_extra``; the sleep gate on top."""
    kwargs: dict[str, Any] = dict(BOOT_TIMEOUTS)
    if mode is not None:
        kwargs["mode"] = mode
    kwargs.update(omni_extra)
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    return kwargs


def register_pipeline_key() -> None:
    """Register a one-stage image pipeline under :data:`PIPELINE_KEY`, as UniRL's ``pipeline_configs.py``
    registers ``unirl_rl_image_diffusion`` (in the process that builds the stage configs)."""
    register_one_stage_pipeline(PIPELINE_KEY)


def deploy_config_text(pipeline_class: str = PIPELINE_CLASS, *, stage_settings: Mapping[str, Any] = ()) -> str:
    """A deploy config as UniRL's ``deploy_configs/qwen_image_t2i_rl.yaml`` is laid out (flat stage keys),
    for the tiny model on the CPU platform (fp32; one request a batch). ``stage_settings``: our extra
    settings under ``extras.prompt_embed_cache``."""
    lines = [
        f"pipeline: {PIPELINE_KEY}",
        "async_chunk: false",
        "stages:",
        "  - stage_id: 0",
        "    max_num_seqs: 1",
        "    enforce_eager: true",
        "    dtype: float32",
        f"    custom_pipeline_args: {{pipeline_class: {pipeline_class}}}",
        f"    worker_extension_cls: {WORKER_EXTENSION}",
    ]
    if stage_settings:
        lines += ["    extras:", "      prompt_embed_cache:"]
        lines += [f"        {name}: {value}" for name, value in stage_settings.items()]
    return "\n".join(lines) + "\n"


class UniRLRollout:
    """One UniRL rollout engine: boot, generate, and the per-step sleep / sync / wake, as its backend does."""

    def __init__(
        self,
        model: str,
        omni_extra: Mapping[str, Any],
        *,
        deploy_config: str | None = None,
        pipeline_class: str = PIPELINE_CLASS,
        mode: str | None = None,
    ) -> None:
        from vllm_omni.entrypoints.omni import Omni

        kwargs = omni_kwargs(omni_extra, mode=mode)
        if deploy_config is not None:
            register_pipeline_key()
            kwargs["deploy_config"] = deploy_config
        else:  # the kwargs-only route: the generic diffusion stage, our pipeline and extension as kwargs
            kwargs.update(
                custom_pipeline_args={"pipeline_class": pipeline_class},
                worker_extension_cls=WORKER_EXTENSION,
                dtype="float32",
                max_num_seqs=1,
            )
        self.omni = Omni(model=model, **kwargs)

    def close(self) -> None:
        self.omni.close()

    def __enter__(self) -> UniRLRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Sequence[Mapping[str, str]], sampling: Mapping[str, Any]) -> list[Any]:
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        return list(self.omni.generate(list(prompts), [OmniDiffusionSamplingParams(**sampling)], use_tqdm=False))

    def worker(self, method: str, *args: Any) -> Any:
        """The first diffusion worker's answer to ``method``."""
        (workers,) = self.omni.engine.collective_rpc(method=method, args=args, stage_ids=[0])  # one stage
        return workers[0]

    def sleep(self) -> None:
        self._every_stage("handle_sleep_task", lambda task_id: _sleep_task(task_id))

    def wake(self) -> None:
        self._every_stage("handle_wake_task", lambda task_id: _wake_task(task_id))

    def _every_stage(self, method: str, task: Any) -> None:
        for stage_id in range(self.omni.engine.num_stages):
            task_id = str(uuid.uuid4())
            acks = self.omni.engine.collective_rpc(method=method, args=(task(task_id),), stage_ids=[stage_id])
            _require_success(method, stage_id, task_id, acks)


def _sleep_task(task_id: str) -> Any:
    from vllm_omni.diffusion.data import OmniSleepTask

    return OmniSleepTask(level=1, task_id=task_id)


def _wake_task(task_id: str) -> Any:
    from vllm_omni.diffusion.data import OmniWakeTask

    return OmniWakeTask(tags=None, task_id=task_id)


def _require_success(method: str, stage_id: int, task_id: str, acks: Any) -> None:
    """UniRL's ACK check: at least one SUCCESS for this stage and task, and no other status."""
    found = []
    pending = [acks]
    while pending:
        ack = pending.pop()
        if isinstance(ack, (list, tuple)):
            pending.extend(ack)
        elif ack is not None:
            found.append(ack)
    for ack in found:
        read = ack.get if isinstance(ack, Mapping) else lambda name, ack=ack: getattr(ack, name, None)
        status = getattr(read("status"), "value", read("status"))
        if str(status).upper() != "SUCCESS" or read("task_id") != task_id:
            raise RuntimeError(f"{method} on stage {stage_id}: {ack!r}")
    if not found:
        raise RuntimeError(f"{method} on stage {stage_id}: no ACK")
