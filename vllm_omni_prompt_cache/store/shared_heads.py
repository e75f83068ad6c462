"""Leading positions that entries share, kept once.

Every prompt of a pipeline starts with the same template (Qwen-Image's system prompt: 34 tokens), and a causal
encoder's outputs at those positions are the same bytes for every prompt that starts so. An entry in device memory
keeps what follows; the head is kept once, here (vLLM's prefix caching shares KV blocks the same way). A head is
shared only where the bytes are equal, compared on every entry made, never assumed: an encoder whose early positions
see later ones (T5, CLIP) shares nothing, at the cost of one comparison per kept tensor. The lower tiers keep whole
tensors (:func:`whole_value`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from vllm_omni_prompt_cache.encoders.forms import Joined, is_entry, whole

#: The fewest leading positions worth a shared head.
MIN_HEAD = 4


def whole_value(value: Any) -> Any:
    """Return an entry's value with every joined leaf made whole (what a lower tier keeps)."""
    if not is_entry(value) or not any(type(leaf) is Joined for leaf in value[2]):
        return value
    return (value[0], value[1], tuple(whole(leaf) for leaf in value[2]))


def head_nbytes(value: Any) -> int:
    """Return the bytes of the shared heads an entry's value is joined to (what its whole tensors add)."""
    return sum(leaf.head.nbytes for leaf in value[2] if type(leaf) is Joined) if is_entry(value) else 0


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, position by position (``-0.0`` and ``0.0`` differ, a NaN equals itself)."""
    return tensor.contiguous().view(torch.uint8)


class SharedHeads:
    """The heads entries of one store share. A head lives as long as an entry joined to it (held weakly here), so
    what the store holds is its entries' tails plus the heads alive (:attr:`nbytes`), and nothing else."""

    def __init__(self) -> None:
        self._heads: dict[tuple, list[weakref.ref]] = {}  # by kind of tensor (device, dtype, trailing sizes)
        self._last: dict[tuple, weakref.ref] = {}  # each kind's last tensor kept whole: a head may start there
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(head.nbytes for head in self._alive())

    def clear(self) -> None:
        with self._lock:
            self._heads.clear()
            self._last.clear()

    def share(self, value: Any) -> Any:
        """Return an entry's value with each row tensor whose leading positions equal a head's joined to it."""
        if not is_entry(value):
            return value
        with self._lock, torch.inference_mode(False):  # tails are normal tensors: a write into one is seen
            return (value[0], value[1], tuple(self._leaf(leaf) for leaf in value[2]))

    def _alive(self) -> list[torch.Tensor]:
        return [head for refs in self._heads.values() for ref in refs if (head := ref()) is not None]

    def _leaf(self, leaf: Any) -> Any:
        if type(leaf) is not torch.Tensor or leaf.dim() < 2 or leaf.shape[0] != 1 or leaf.shape[1] < MIN_HEAD:
            return leaf
        if leaf.layout is not torch.strided or leaf.is_meta or not leaf.numel():  # no bytes to compare
            return leaf
        if not leaf.is_contiguous():  # rebuilt by concatenation it would be contiguous: served with other strides
            return leaf
        kind = (leaf.device, leaf.dtype, tuple(leaf.shape[2:]))
        heads = [head for ref in self._heads.get(kind, ()) if (head := ref()) is not None]
        for head in heads:
            if head.shape[1] <= leaf.shape[1] and torch.equal(_bytes(leaf[:, : head.shape[1]]), _bytes(head)):
                return Joined(head, leaf[:, head.shape[1] :].clone())
        # A new head: the positions this tensor shares with a head (which then ended too late), else with the last
        # tensor kept whole; so heads shrink to what every prompt shares (the template), not what two happen to.
        length = max((_common_head(head, leaf) for head in heads), default=0)
        last = self._last.get(kind)
        previous = None if last is None else last()
        if length < MIN_HEAD and previous is not None and previous is not leaf:
            length = _common_head(previous, leaf)
        if length < MIN_HEAD:
            self._last[kind] = weakref.ref(leaf)
            return leaf
        head = leaf[:, :length].clone()
        self._heads[kind] = [weakref.ref(alive) for alive in heads] + [weakref.ref(head)]
        return Joined(head, leaf[:, length:].clone())


def _common_head(first: torch.Tensor, second: torch.Tensor) -> int:
    """Return how many leading positions two row tensors hold the same bytes at."""
    length = min(first.shape[1], second.shape[1])
    same = (_bytes(first[0, :length]).reshape(length, -1) == _bytes(second[0, :length]).reshape(length, -1)).all(1)
    differs = (~same).nonzero()
    return int(differs[0, 0]) if len(differs) else length
