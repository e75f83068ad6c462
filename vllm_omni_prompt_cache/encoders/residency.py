"""Where the text encoders live between calls, and what moving them costs.

Two things move a pipeline's text encoders between host and device memory: vLLM-Omni's module
offload (its hooks swap the encoder and the DiT around every forward: see
:mod:`.vllm_omni.offload`) and :class:`EncoderPlacement`, this package's "encoder on the device
only for a miss". Both report to one :class:`EncoderMoves`, whose counts the store's snapshot
reads through its ``counts()`` (``stats()``, ``/metrics``): placements and evictions made, bytes moved, and the
placements a cache hit avoided (the encode that did not run would have placed the encoder).

:class:`EncoderPlacement` keeps one host master of every encoder tensor (pinned on a CUDA host)
and points the parameters at it between calls. The call that owns a miss copies the masters to
the device, encodes, and points the parameters back at the masters: eviction copies nothing,
since inference never writes the weights. A weight load between calls writes into the masters.
On the CPU platform the "device" copy is a second host copy, so where the parameters live is
still observable (their storage is the master's, or not).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from vllm_omni_prompt_cache.counts.counters import (
    BYTES_MOVED,
    BYTES_NOT_MOVED,
    DIT_EVICTIONS,
    DIT_PLACEMENTS,
    ENCODER_EVICTIONS,
    ENCODER_PLACEMENTS,
    PLACEMENTS_AVOIDED,
    Count,
    Keeper,
    read_counts,
    zero_counts,
)
from vllm_omni_prompt_cache.encoders.fingerprint import ENCODE_DEVICE

logger = logging.getLogger(__name__)

#: Attribute of a pipeline whose text encoders are on the device only while a call encodes
#: (its :class:`EncoderPlacement`).
PLACEMENT_ATTRIBUTE = "_prompt_embed_cache_placement"
#: Who places the encoder (the ``encoder_placement`` level of a snapshot).
VLLM_OMNI_OFFLOAD = "vllm-omni module offload"
ON_MISS = "on a miss"


def module_tensors(*modules: torch.nn.Module) -> list[torch.Tensor]:
    """Return the parameters and buffers of ``modules``, each once (tied weights are one tensor)."""
    seen: set[int] = set()
    tensors = []
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
    return tensors


def module_nbytes(module: torch.nn.Module) -> int:
    """Return the bytes of ``module``'s parameters and buffers."""
    return sum(tensor.nbytes for tensor in module_tensors(module))


class EncoderMoves:
    """Counts of the moves between host and device that text encoders (and the DiTs they swap with) make.

    Each mover adds a source: ``served()``, told of each call the cache served without encoding
    (it reports what that spared through :meth:`avoided`, when it knows), and ``device_bytes()``,
    the text-encoder bytes it holds on the device now.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: list[tuple[str, Callable[[], None], Callable[[], int]]] = []
        self._counts = zero_counts(Keeper.MOVES)  # what each move, or avoided placement, adds

    def add_source(self, placer: str, served: Callable[[], None], device_bytes: Callable[[], int]) -> None:
        """Count what ``placer`` moves (see the class docstring)."""
        with self._lock:
            self._sources.append((placer, served, device_bytes))

    @property
    def placer(self) -> str:
        """Return who moves the encoders (and DiTs): the sources' names."""
        return " + ".join(placer for placer, _, _ in self._sources)

    def moved(self, *, encoder: bool, placed: bool, nbytes: int) -> None:
        """Count one move of a module: a text encoder or a DiT, placed on or evicted from the device."""
        if encoder:
            move = ENCODER_PLACEMENTS if placed else ENCODER_EVICTIONS
        else:
            move = DIT_PLACEMENTS if placed else DIT_EVICTIONS
        with self._lock:
            self._counts[move] += 1
            self._counts[BYTES_MOVED] += nbytes

    def avoided(self, placements: int, nbytes: int) -> None:
        """Count encoder placements (and the bytes of every move they bring) that did not happen."""
        with self._lock:
            self._counts[PLACEMENTS_AVOIDED] += placements
            self._counts[BYTES_NOT_MOVED] += nbytes

    def counts(self) -> dict[Count, Any]:
        """Return the moves counted since this was made: placements and evictions of the text encoders and DiTs,
        the bytes they copied, and the placements (and bytes) that calls served from the cache avoided."""
        with self._lock:
            return read_counts(self._counts)

    def served_without_encoding(self) -> None:
        """Tell every source that a call was served from the cache."""
        for _, served, _ in self._sources:
            served()

    def device_bytes(self) -> int:
        """Return the bytes of text-encoder tensors on the device now."""
        return sum(device_bytes() for _, _, device_bytes in self._sources)


class EncoderPlacement:
    """Text encoders kept in host memory, on ``device`` only while a call that runs them is open.

    A cached call opens a :meth:`session` (re-entrant, thread-safe); the wrapper places the encoders
    with :meth:`held` before it calls the original (a miss or a bypass), and the end of the last
    open session takes them off. A call served from the cache moves nothing. A forward of an
    encoder module outside any such call (code no cached method brackets) places the encoders too
    (counted in ``stray_placements``, said once in the log); they leave when that encoder's forward
    returns, else at :meth:`settle` (before weights load, before sleep) or the next session's end.
    """

    def __init__(self, encoders: Mapping[str, torch.nn.Module], device: torch.device, moves: EncoderMoves) -> None:
        if not encoders:
            raise ValueError("no text encoder to place")
        self.encoders = dict(encoders)
        self.device = torch.device(device)
        self.moves = moves
        self._pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._masters: dict[int, torch.Tensor] = {}  # by id of the module tensor
        self._placed: dict[int, tuple[torch.Tensor, int]] = {}  # tensor, and its device copy's data_ptr
        # Kept as the tensors move, so a hit and a snapshot read them without walking the encoders.
        self._master_bytes = self._placed_bytes = 0
        self._sessions = 0
        self._lock = threading.RLock()
        self.stray_placements = 0
        self._hooks: list[Any] = []
        with torch.no_grad():
            for tensor in self._tensors():
                self._adopt(tensor)
        self._master_bytes = sum(master.nbytes for master in self._masters.values())
        for module in self.encoders.values():
            object.__setattr__(module, ENCODE_DEVICE, self.device)
            for each in module.modules():
                if each._parameters or each._buffers:
                    self._hooks.append(each.register_forward_pre_hook(self._before_forward))
            self._hooks.append(module.register_forward_hook(self._after_encoder_forward, always_call=True))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        moves.add_source(ON_MISS, self._served, self.device_bytes)

    def _tensors(self) -> list[torch.Tensor]:
        return module_tensors(*self.encoders.values())

    def _adopt(self, tensor: torch.Tensor) -> None:
        """Make ``tensor``'s host copy its master, and point it there (pinned when the device is CUDA)."""
        data = tensor.data
        if data.device.type != "cpu" or (self._pin and not data.is_pinned()):
            host = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=self._pin)
            data = host.copy_(data)
        self._masters[id(tensor)] = data
        tensor.data = data

    def _served(self) -> None:
        """A call was served from the cache: each missing call places the encoders, so this one spared that."""
        if not self._placed:  # read without the lock: on the hit path, and a stale read only miscounts
            self.moves.avoided(len(self.encoders), self._master_bytes)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Let encoder forwards in the block place the encoders; take them off when the last session ends."""
        with self._lock:
            self._sessions += 1
        try:
            yield
        finally:
            with self._lock:
                self._sessions -= 1
                if self._sessions == 0 and self._placed:
                    self._evict()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the encoders on the device for the block, whether it runs them or not (memory profiling:
        its peak must be a miss's, encoders included)."""
        with self.session():
            with self._lock:
                if not self._placed:
                    self._place()
            yield

    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        if self._placed:  # read without the lock: set only under it, by this or the session's thread
            return
        with self._lock:
            if self._placed:
                return
            if not self._sessions:
                self.stray_placements += 1
                if self.stray_placements == 1:
                    logger.warning(
                        "Prompt-embed cache: %s ran outside a cached encode method; the text encoders are placed "
                        "on %s until the next cached call ends (counted in stray_placements).",
                        type(module).__name__,
                        self.device,
                    )
            self._place()

    def _after_encoder_forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._placed and not self._sessions:  # a stray forward of a whole encoder ended
            self.settle()

    def settle(self) -> None:
        """Take the encoders off the device if a stray forward left them there (no session is open):
        before weights are written (they must reach the masters) and before sleep."""
        with self._lock:
            if self._placed and not self._sessions:
                self._evict()

    def _place(self) -> None:
        """Copy every encoder tensor's master to the device (a tensor new since the last placement, or
        one whose data was replaced on the host, becomes its own master first). Lock held."""
        tensors = self._tensors()
        current = {id(tensor) for tensor in tensors}
        self._masters = {key: master for key, master in self._masters.items() if key in current}
        # Placed by an encoder forward that may run under inference mode: the weights must stay normal tensors.
        with torch.inference_mode(False), torch.no_grad():
            for tensor in tensors:
                master = self._masters.get(id(tensor))
                if master is None or tensor.data_ptr() != master.data_ptr():
                    if tensor.device.type != "cpu" and self.device.type != "cpu":
                        continue  # already on the device, and not ours to move
                    self._adopt(tensor)
                    master = self._masters[id(tensor)]
                placed = master.to(self.device, non_blocking=self._pin, copy=True)
                tensor.data = placed
                self._placed[id(tensor)] = (tensor, placed.data_ptr())
        self._master_bytes = sum(master.nbytes for master in self._masters.values())
        self._placed_bytes = sum(tensor.nbytes for tensor, _ in self._placed.values())
        for module in self.encoders.values():
            self.moves.moved(encoder=True, placed=True, nbytes=module_nbytes(module))

    def _evict(self) -> None:
        """Point every placed tensor back at its master; one whose data was replaced while placed (a write
        that did not go through :meth:`settle` first) is copied to the host as its new master. Lock held."""
        copied = 0
        with torch.inference_mode(False), torch.no_grad():
            for tensor, placed_ptr in self._placed.values():
                if tensor.data_ptr() == placed_ptr:
                    tensor.data = self._masters[id(tensor)]
                else:
                    copied += tensor.nbytes
                    self._adopt(tensor)
        self._placed.clear()
        self._placed_bytes = 0
        self._master_bytes = sum(master.nbytes for master in self._masters.values())
        for _ in self.encoders:
            self.moves.moved(encoder=True, placed=False, nbytes=copied)
            copied = 0  # the copies are counted once, with the first encoder's eviction

    def device_bytes(self) -> int:
        """Return the bytes of encoder tensors placed on the device now (0 between calls)."""
        return self._placed_bytes

    def host_bytes(self) -> int:
        """Return the bytes of the host masters."""
        return self._master_bytes

    def remove(self) -> None:
        """Put every encoder back on the device for good and forget the masters (uninstall)."""
        with self._lock:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            with torch.no_grad():
                for tensor in self._tensors():
                    tensor.data = tensor.data.to(self.device, copy=True)  # its own storage, not the master
            for module in self.encoders.values():
                if getattr(module, ENCODE_DEVICE, None) is not None:
                    object.__delattr__(module, ENCODE_DEVICE)
            self._masters.clear()
            self._placed.clear()


def on_encode_device(run: Callable[[tuple, dict], Any], device: torch.device) -> Callable[[tuple, dict], Any]:
    """Return ``run`` for an encoder that waits off its device between calls (an offload, a placement on a miss):
    inputs that code put where the encoder waited go where it runs, and its output comes back beside them."""

    def placed(args: tuple, kwargs: dict) -> Any:
        given = next((value.device for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)), None)
        if given is None or given == device:
            return run(args, kwargs)
        moved = tree_map(lambda value: value.to(device) if isinstance(value, torch.Tensor) else value, (args, kwargs))
        output = run(*moved)
        return tree_map(lambda value: value.to(given) if isinstance(value, torch.Tensor) else value, output)

    return placed
