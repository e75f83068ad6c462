"""vLLM-Omni's offload and the text encoder: its moves counted, and the placement setting checked against it.

With module offload (``enable_cpu_offload``, ``diffusion_offload_config={"mode": "module"}``) each
encoder and DiT gets a ``SequentialOffloadHook`` whose ``_to_gpu`` / ``_to_cpu`` move a module's
tensors to the device or to pinned host memory; an encoder's forward evicts the DiTs and places
the encoder, a DiT's forward does the reverse. :func:`observe_module_offload` wraps those two
methods on each hook instance (nothing else of the hook changes) and counts every move into an
:class:`~vllm_omni_prompt_cache.encoders.residency.EncoderMoves`. It keeps its own record of where each
module is: on a GPU that is where its tensors are; on the CPU platform the hooks' device is the
host and nothing moves, and the record says what a GPU would have moved.

:func:`refusal_with_offload` says why ``prompt_embed_cache_encoder_on_miss`` cannot run with the
offload a pipeline has: two owners of one encoder's placement would copy it back and forth.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from vllm_omni_prompt_cache.encoders.fingerprint import ENCODE_DEVICE, pipeline_attributes
from vllm_omni_prompt_cache.encoders.residency import VLLM_OMNI_OFFLOAD, EncoderMoves, module_nbytes
from vllm_omni_prompt_cache.encoders.text_encoders import (
    text_encoders as pipeline_text_encoders,  # the name is a keyword here
)

logger = logging.getLogger("vllm_omni_prompt_cache")

#: The name vLLM-Omni registers its module-offload hook under (``SequentialOffloadHook._HOOK_NAME``).
SEQUENTIAL_HOOK = "sequential_offload"


def sequential_hook(module: Any) -> Any:
    """Return the module-offload hook vLLM-Omni registered on ``module``, or None."""
    registry = getattr(module, "_hook_registry", None)
    get_hook = getattr(registry, "get_hook", None)
    return get_hook(SEQUENTIAL_HOOK) if callable(get_hook) else None


def _hooked_modules(pipeline: Any) -> dict[str, torch.nn.Module]:
    return {
        name: value
        for name, value in pipeline_attributes(pipeline)
        if isinstance(value, torch.nn.Module) and sequential_hook(value) is not None
    }


def _layerwise(module: torch.nn.Module) -> bool:
    return any(getattr(each, "_omni_layerwise_enabled", False) for each in module.modules())


def refusal_with_offload(pipeline: Any) -> str | None:
    """Return why the text encoders cannot be placed on a miss with the offload ``pipeline`` has, or None."""
    for name, module in pipeline_text_encoders(pipeline).items():
        hook = sequential_hook(module)
        if hook is not None and getattr(hook, "offload_after_context", False):
            return (
                f"vLLM-Omni's module offload moves {name} itself (enable_cpu_offload, or diffusion_offload_config "
                'selecting "text_encoder"); offload only the DiT (diffusion_offload_config={"mode": "module", '
                '"components": ["dit"]}) or turn one of the two off'
            )
        if _layerwise(module):
            return (
                f"vLLM-Omni's layer-wise offload streams {name}'s blocks (enable_layerwise_offload, or "
                'diffusion_offload_config {"mode": "layer"} with the text encoder among its components); offload '
                'only the DiT ("components": ["dit"]) or turn one of the two off'
            )
    return None


class ModuleOffloadRecord:
    """Where each hooked module is, as vLLM-Omni's module offload moved it, with the moves an encode
    made counted: a text encoder's placements and evictions, and the DiTs its hook evicted for it
    (and their return). A DiT another DiT's hook swaps (Wan2.2's two experts) is tracked, not counted.

    ``text_encoders=False``: another mover owns the text encoders' placement (see :mod:`.residency`);
    their moves are not counted here, the DiT moves their forwards cause are.
    """

    def __init__(
        self,
        pipeline: Any,
        hooked: dict[str, torch.nn.Module],
        moves: EncoderMoves,
        *,
        text_encoders: bool,
        after_a_forward: bool = False,
    ) -> None:
        texts = {id(module) for module in pipeline_text_encoders(pipeline).values()}
        self._lock = threading.Lock()
        self._count_text_encoders = text_encoders
        self._text_encoders = [(module, sequential_hook(module)) for module in hooked.values() if id(module) in texts]
        self._nbytes = {id(module): module_nbytes(module) for module in hooked.values()}
        self._is_text_encoder = {id(module): id(module) in texts for module in hooked.values()}
        self._on_device: dict[int, bool] = {}
        for module in hooked.values():
            hook = sequential_hook(module)
            tensors = [*module.parameters(), *module.buffers()]
            self._on_device[id(module)] = all(tensor.device == _device(hook.device) for tensor in tensors)
        if after_a_forward:  # attached after the engine ran: as the last DiT forward left them
            for module in hooked.values():
                if not self._is_text_encoder[id(module)]:
                    self._on_device[id(module)] = True
                    for target in sequential_hook(module).offload_targets:
                        if id(target) in self._on_device:
                            self._on_device[id(target)] = False
        self._evicted_for_encode: set[int] = set()  # DiTs a text encoder's hook moved to the host
        # What calls served from the cache spared since the last DiT forward: committed at the next one,
        # dropped if an encode places the encoder first (it would have found it placed anyway).
        self._pending: tuple[int, int] | None = None
        self.moves = moves
        moves.add_source(VLLM_OMNI_OFFLOAD, self.served, self._device_bytes)

    def moved(self, hook: Any, module: torch.nn.Module, *, on_device: bool) -> None:
        """Record that ``hook`` placed (or evicted) ``module``, and count it when an encode made it."""
        key = id(module)
        if key not in self._nbytes:  # a module we did not find hooked: not counted
            return
        text_encoder = self._is_text_encoder[key]
        counted = False
        with self._lock:
            changed = self._on_device[key] != on_device
            self._on_device[key] = on_device
            if not text_encoder:
                if on_device and hook is sequential_hook(module):  # the DiT's own forward
                    if self._pending is not None:
                        self.moves.avoided(*self._pending)
                        self._pending = None
                    if changed and key in self._evicted_for_encode:
                        self._evicted_for_encode.discard(key)
                        counted = True
                elif not on_device and changed and hook in self._encoder_hooks():
                    self._evicted_for_encode.add(key)
                    counted = True
            elif changed:
                if on_device:
                    self._pending = None  # an encode placed it: nothing was spared
                counted = self._count_text_encoders
        if counted:
            self.moves.moved(encoder=text_encoder, placed=on_device, nbytes=self._nbytes[key])

    def _encoder_hooks(self) -> list[Any]:
        return [hook for _, hook in self._text_encoders]

    def served(self) -> None:
        """A call was served without encoding: hold what an encode now would have moved (each text
        encoder off the device placed; the DiTs their hooks evict, each once, leave and come back;
        a selected encoder leaves again at the next DiT forward) until the next DiT forward."""
        placements = nbytes = 0
        targets: dict[int, torch.nn.Module] = {}
        with self._lock:
            if self._pending is not None:
                return
            for module, hook in self._text_encoders:
                if not self._on_device[id(module)] and self._count_text_encoders:
                    placements += 1
                    trips = 2 if getattr(hook, "offload_after_context", False) else 1
                    nbytes += trips * self._nbytes[id(module)]
                for target in hook.offload_targets:
                    if self._on_device.get(id(target), False):
                        targets[id(target)] = target
            nbytes += sum(2 * self._nbytes.get(key, 0) for key in targets)
            if placements or nbytes:
                self._pending = (placements, nbytes)

    def _device_bytes(self) -> int:
        if not self._count_text_encoders:
            return 0
        with self._lock:
            return sum(self._nbytes[id(module)] for module, _ in self._text_encoders if self._on_device[id(module)])


def _device(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def observe_module_offload(
    pipeline: Any, moves: EncoderMoves, *, text_encoders: bool = True, after_a_forward: bool = False
) -> ModuleOffloadRecord | None:
    """Count the moves vLLM-Omni's module offload makes on ``pipeline`` into ``moves``; None when it has
    none. ``text_encoders=False``: another mover owns them (see :mod:`.residency`); count the DiTs only.
    ``after_a_forward``: the engine already ran (on the CPU platform, where nothing really moves, the
    record then starts as a DiT forward leaves the modules, not as start-up placed them)."""
    hooked = _hooked_modules(pipeline)
    if not hooked:
        return None
    record = ModuleOffloadRecord(pipeline, hooked, moves, text_encoders=text_encoders, after_a_forward=after_a_forward)
    for module in hooked.values():
        _observe(sequential_hook(module), record)
    for module in pipeline_text_encoders(pipeline).values() if text_encoders else ():
        hook = sequential_hook(module)
        if hook is not None:
            object.__setattr__(module, ENCODE_DEVICE, torch.device(hook.device))
    logger.info(
        "vllm-omni-prompt-cache: counting the text encoder's moves under vLLM-Omni's module offload (%s).",
        ", ".join(hooked),
    )
    return record


def _observe(hook: Any, record: ModuleOffloadRecord) -> None:
    """Make ``record`` count ``hook``'s moves: its ``_to_gpu`` / ``_to_cpu`` (which the hook calls through
    ``self``) are shadowed once by counting ones; a later record (the cache installed again) replaces it."""
    hook._prompt_embed_cache_record = record
    if getattr(hook, "_prompt_embed_cache_observed", False):
        return
    to_gpu, to_cpu = hook._to_gpu, hook._to_cpu

    def counted_to_gpu(module: torch.nn.Module) -> None:
        to_gpu(module)
        hook._prompt_embed_cache_record.moved(hook, module, on_device=True)

    def counted_to_cpu(module: torch.nn.Module) -> None:
        to_cpu(module)
        hook._prompt_embed_cache_record.moved(hook, module, on_device=False)

    hook._to_gpu, hook._to_cpu = counted_to_gpu, counted_to_cpu
    hook._prompt_embed_cache_observed = True
