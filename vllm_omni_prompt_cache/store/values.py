"""What an entry's value is made of: its tensors, the memory they hold, and copies it must own.

An encode returns tensors in tuples, lists, dicts and named tuples. Keeping one costs the bytes of
every distinct storage it holds alive; it must not hold autograd history, nor memory the caller
still owns (an input handed back), or the entry would change when the caller reuses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import numpy as np
import torch


def map_tensors(value: Any, convert: Any) -> Any:
    """Return ``value`` with each tensor replaced by ``convert(tensor)`` (tuples, lists, dicts rebuilt)."""
    if isinstance(value, torch.Tensor):
        return convert(value)
    if isinstance(value, tuple):
        mapped = [map_tensors(item, convert) for item in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    if isinstance(value, list):
        return [map_tensors(item, convert) for item in value]
    if isinstance(value, dict):
        mapped = {key: map_tensors(item, convert) for key, item in value.items()}
        if type(value) is dict:
            return mapped
        try:  # a ModelOutput (a dataclass over an OrderedDict), an OrderedDict: served as the class it was
            return type(value)(**mapped) if dataclasses.is_dataclass(value) else type(value)(mapped)
        except Exception:
            return mapped
    return value


def detach_value(value: Any) -> Any:
    """Return ``value`` with every tensor detached from autograd (containers rebuilt)."""
    return map_tensors(value, torch.Tensor.detach)


def owned_by_cache(value: Any) -> Any:
    """Return ``value`` with each inference-mode tensor copied into a normal one: torch counts in-place
    changes of normal tensors only (their version counter), and the cache must see a caller's."""

    def own(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_inference():
            return tensor
        with torch.inference_mode(False):
            return tensor.clone()

    return map_tensors(value, own)


def tensor_versions(value: Any) -> tuple[tuple[torch.Tensor, int], ...]:
    """Return each tensor of ``value`` with its version counter now (what the look-ups compare to drop an entry a
    caller wrote into, see :func:`.lookups.changed_in_place`)."""
    found: list[tuple[torch.Tensor, int]] = []

    def note(tensor: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(RuntimeError):  # a tensor without a counter (inference mode) is not noted
            found.append((tensor, tensor._version))
        return tensor

    map_tensors(value, note)
    return tuple(found)


def value_nbytes(value: Any) -> int:
    """Return the bytes of tensor storage that keeping ``value`` holds alive (shared storage once)."""
    seen: dict[tuple[str, int], int] = {}

    def visit(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[(str(item.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(item, (tuple, list)):
            for element in item:
                visit(element)
        elif isinstance(item, dict):
            for element in item.values():
                visit(element)

    visit(value)
    return sum(seen.values())


def _memory(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """Return the memory a tensor's storage spans (device, start, end), or None when it has none to read."""
    try:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        return (str(tensor.device), start, start + storage.nbytes())
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, wrapper subclasses
        return None


def _input_memory(value: Any, found: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Collect the memory of the tensors and numpy arrays in keyed arguments (acyclic, of known types)."""
    if isinstance(value, torch.Tensor):
        memory = _memory(value)
        if memory is not None:
            found.append(memory)
    elif isinstance(value, np.ndarray):
        start, end = np.lib.array_utils.byte_bounds(value)
        found.append(("cpu", start, end))
    elif isinstance(value, (tuple, list)):
        for item in value:
            _input_memory(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _input_memory(item, found)
    return found


def unaliased(value: Any, inputs: Any) -> Any:
    """Return ``value`` with each tensor whose memory overlaps a tensor or array of ``inputs`` cloned.

    An encode may hand one of its inputs back, or build an output on it (verl-omni's LTX-2
    ``_encode_token_ids`` returns a slice of the mask it was given when the ids need no padding);
    kept as is, the entry would change when the caller reuses that buffer.
    """
    shared = _input_memory(inputs, [])
    if not shared:
        return value

    def own(tensor: torch.Tensor) -> torch.Tensor:
        memory = _memory(tensor)
        if memory is not None and any(
            memory[0] == device and memory[1] < end and start < memory[2] for device, start, end in shared
        ):
            return tensor.clone()
        return tensor

    return map_tensors(value, own)
