"""An encoder output's form (containers, field names, each tensor's shape and dtype, plain values) and its leaves,
and an entry's value: the form spelled as one string and the leaves kept. A kept tensor may be a head entries share
and its own tail (:class:`Joined`: how device memory keeps a prompt template once, :mod:`~.store.shared_heads`).
Nothing here knows about vLLM-Omni or the store.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

#: The tag of an entry's value (its form, then its kept leaves): a value without it was not made here.
ENTRY_TAG = "encoder-output/1"


class Unkeepable(Exception):
    """An output whose form cannot be kept: an object outside a model output's fields, a key that is no string."""


def _is_model_output(value: Any) -> bool:
    """A ``transformers`` ``ModelOutput``: a dataclass that is an ordered dict of its set fields."""
    return isinstance(value, OrderedDict) and dataclasses.is_dataclass(value)


def take_apart(output: Any) -> tuple[tuple, list[Any]]:
    """Return ``output``'s form and its leaves, in the order the form numbers them."""
    leaves: list[Any] = []
    return _form(output, leaves, in_fields=False), leaves


def _form(value: Any, leaves: list[Any], *, in_fields: bool) -> tuple:
    kind = type(value)
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return ("tensor", len(leaves) - 1, tuple(value.shape), str(value.dtype).removeprefix("torch."))
    if value is None:
        return ("none",)
    if kind in (bool, int, float, str):
        return ("value", value)
    if kind in (tuple, list):
        return (kind.__name__, tuple(_form(item, leaves, in_fields=False) for item in value))
    if kind is dict:
        if not all(type(key) is str for key in value):
            raise Unkeepable("a dict whose keys are not all strings")
        return ("dict", tuple((key, _form(item, leaves, in_fields=False)) for key, item in value.items()))
    if _is_model_output(value):
        spelled = f"{_plain_class(kind).__module__}:{_plain_class(kind).__qualname__}"
        fields = tuple((name, _form(item, leaves, in_fields=True)) for name, item in dict.items(value))
        return ("output", spelled, fields)
    if not in_fields and _is_attributes_output(value):  # vLLM-Omni's MistralEncoderOutput: its fields, as attributes
        spelled = f"{_plain_class(kind).__module__}:{_plain_class(kind).__qualname__}"
        fields = tuple((name, _form(item, leaves, in_fields=True)) for name, item in vars(value).items())
        return ("output", spelled, fields, ATTRIBUTES)
    if in_fields:  # a KV cache, say: never kept, fetched by a hit that reads it
        leaves.append(value)
        return ("object", len(leaves) - 1)
    raise Unkeepable(f"a {kind.__module__}.{kind.__qualname__} outside a model output's fields")


#: Marks the form of an output whose fields are plain attributes (an object with a ``__dict__``, no ordered dict).
ATTRIBUTES = "attributes"


def _is_attributes_output(value: Any) -> bool:
    """An object of a class of Python's that holds its fields as attributes named as its ``__init__``'s parameters,
    rebuilt by setting them (no torch module, no ordered dict)."""
    kind = type(value)
    if isinstance(value, (torch.nn.Module, dict, tuple, list)) or kind.__module__ == "builtins":
        return False
    try:
        names = list(inspect.signature(kind.__init__).parameters)[1:]
        attributes = vars(value)
    except (TypeError, ValueError):
        return False
    return bool(attributes) and set(attributes) <= set(names)


def _plain_class(kind: type) -> type:
    return getattr(kind, "_plain_class", kind)


def tensor_leaves(form: tuple) -> Iterator[tuple]:
    """Yield the ``("tensor", index, shape, dtype)`` parts of ``form``."""
    tag = form[0]
    if tag == "tensor":
        yield form
    elif tag in ("tuple", "list"):
        for item in form[1]:
            yield from tensor_leaves(item)
    elif tag == "dict":
        for _, item in form[1]:
            yield from tensor_leaves(item)
    elif tag == "output":
        for _, item in form[2]:
            yield from tensor_leaves(item)


def splits(form: tuple, size: int) -> bool:
    """Return True when every tensor of an output of ``form`` leads with ``size``."""
    return all(len(part[2]) >= 1 and part[2][0] == size for part in tensor_leaves(form))


def row_form(form: tuple, rows: int) -> tuple:
    """Return ``form`` with each tensor's leading size set to ``rows``."""
    tag = form[0]
    if tag == "tensor":
        return ("tensor", form[1], (rows, *form[2][1:]), form[3])
    if tag in ("tuple", "list"):
        return (tag, tuple(row_form(item, rows) for item in form[1]))
    if tag == "dict":
        return (tag, tuple((key, row_form(item, rows)) for key, item in form[1]))
    if tag == "output":
        return (tag, form[1], tuple((key, row_form(item, rows)) for key, item in form[2]), *form[3:])
    return form


def skeleton(form: tuple) -> tuple:
    """Return ``form`` without its tensors' sizes: what calls of one kind share."""
    tag = form[0]
    if tag == "tensor":
        return ("tensor", form[1], len(form[2]), form[3])
    if tag in ("tuple", "list"):
        return (tag, tuple(skeleton(item) for item in form[1]))
    if tag == "dict":
        return (tag, tuple((key, skeleton(item)) for key, item in form[1]))
    if tag == "output":
        return (tag, form[1], tuple((key, skeleton(item)) for key, item in form[2]), *form[3:])
    return form


def kept(form: tuple, leaves: list[Any], keep: set[int] | None) -> tuple:
    """Return an entry's value: the form (spelled as one string: what a store walks stays three items) and a copy of
    each tensor leaf in ``keep`` (None: every tensor): normal tensors, whose writes the store sees (an inference-mode
    copy would be copied again there)."""
    with torch.inference_mode(False):
        stored = tuple(
            leaf.detach().clone() if isinstance(leaf, torch.Tensor) and (keep is None or index in keep) else None
            for index, leaf in enumerate(leaves)
        )
    return (ENTRY_TAG, spelled(form), stored)


@functools.lru_cache(maxsize=1024)
def spelled(form: tuple) -> str:
    """Return ``form`` as the string an entry keeps."""
    return json.dumps(form, separators=(",", ":"))


@functools.lru_cache(maxsize=1024)
def form_of(spelled_form: str) -> tuple:
    """Return the form an entry's string spells (parsed once per form)."""
    return _tuples(json.loads(spelled_form))


def _tuples(value: Any) -> Any:
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def is_entry(value: Any) -> bool:
    """Whether a stored value is an encoder output's entry (any other is a method's value: compared with nothing)."""
    return type(value) is tuple and len(value) == 3 and type(value[0]) is str and value[0] == ENTRY_TAG


class Joined(NamedTuple):
    """A kept tensor of one row (``[1, positions, ...]``) as a head entries share and the positions of its own."""

    head: torch.Tensor
    tail: torch.Tensor


def whole(leaf: Any) -> Any:
    """Return a kept leaf as the one tensor it stands for (a new one when it was joined)."""
    return torch.cat(leaf, dim=1) if type(leaf) is Joined else leaf
