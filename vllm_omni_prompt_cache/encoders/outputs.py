"""What an entry keeps of a text encoder's output, and the output a hit hands back.

A text encoder returns more than an encode reads: Qwen-Image asks Qwen2.5-VL for every layer's hidden states
(``output_hidden_states=True``) and reads the last one, beside logits over the vocabulary and a KV cache. So an
output is taken apart into its **form** (containers, field names, each tensor's shape and dtype, plain values) and
its **leaves** (tensors and other objects). The leaves an encode was seen to take out of their containers
(:class:`Reads`) are kept; a hit hands back an output of the same form with fresh copies of the kept leaves, and
every other tensor as a :class:`Deferred` tensor, which runs the encoder for real the first time anything but
its shape is asked of it. Any other object a hit's encode reads (a KV cache) is fetched the same way. What an
entry lacks therefore costs an encode, never a wrong value. Forms and entries are :mod:`.forms`'. Nothing here knows
about vLLM-Omni or the store.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_omni_prompt_cache.encoders.forms import ATTRIBUTES, Joined, form_of, tensor_leaves, whole


class Reads:
    """Which leaves of one encoder output its encode took out of their containers. A tuple it was handed but took no
    item out of (``torch.stack(out.hidden_states)``: C code reads it in place, unseen) counts as read whole."""

    def __init__(self) -> None:
        self.leaves: set[int] = set()
        self.tuples: dict[int, list] = {}  # id of a reading tuple -> [its leaves, handed out, an item taken out]

    def kept(self) -> set[int]:
        """Return the leaves to keep: those taken out, and every leaf of a tuple handed out whole."""
        whole = (
            index for leaves, handed, itemized in self.tuples.values() if handed and not itemized for index in leaves
        )
        return self.leaves | set(whole)


# --- A miss: the real output, in containers that note what is read ------------------------------------------------


class ReadingTuple(tuple):
    """A tuple that notes which of its items are read (``hidden_states[-1]``, unpacking, iteration). Read whole by C
    code (``torch.stack``), none is noted: a hit then fetches those it lacks."""

    __slots__ = ()
    _indices: tuple[int, ...]
    _reads: Reads

    def __new__(cls, items: tuple, indices: tuple[int | None, ...], reads: Reads, *, handed: bool) -> ReadingTuple:
        made = super().__new__(cls, items)
        _TUPLE_NOTES[id(made)] = (indices, reads)
        reads.tuples[id(made)] = [[index for index in indices if index is not None], handed, False]
        return made

    def _note(self, positions: range | list[int]) -> None:
        notes = _TUPLE_NOTES.get(id(self))
        if notes is not None:
            indices, reads = notes
            reads.leaves.update(indices[position] for position in positions if indices[position] is not None)
            reads.tuples[id(self)][2] = True

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            self._note(range(len(self))[index])
            return tuple(tuple.__getitem__(self, index))
        self._note([range(len(self))[index]])
        return tuple.__getitem__(self, index)

    def __iter__(self) -> Iterator[Any]:
        self._note(range(len(self)))
        return tuple.__iter__(self)

    def __del__(self) -> None:
        _TUPLE_NOTES.pop(id(self), None)


#: A reading tuple's leaf indices and reads, by its id (a tuple subclass with ``__slots__ = ()`` holds no attributes).
_TUPLE_NOTES: dict[int, tuple[tuple[int | None, ...], Reads]] = {}


def reading(output: Any, form: tuple, reads: Reads, *, handed: bool = True) -> Any:
    """Return ``output`` as its encode gets it on a miss: the same leaves, in containers that note in ``reads``
    which of them the encode takes out. A leaf no container hands out (a bare tensor) counts as read."""
    if form[0] == "tensor":
        reads.leaves.add(form[1])
        return output
    if form[0] == "tuple" and type(output) is tuple:
        indices = tuple(item[1] if item[0] == "tensor" else None for item in form[1])
        others = [item for item in form[1] if item[0] != "tensor"]
        for item in others:  # nested containers: read whole
            reads.leaves.update(part[1] for part in tensor_leaves(item))
        return ReadingTuple(output, indices, reads, handed=handed)
    if form[0] == "output":
        for name, item in form[2]:
            if item[0] == "tuple" and type(_field(output, name)) is tuple:
                _set_field(output, name, reading(_field(output, name), item, reads, handed=False))  # handed when read
        object.__setattr__(output, "__class__", _reading_class(type(output), tuple(name for name, _ in form[2])))
        _OUTPUT_NOTES[id(output)] = (form, reads, None)
        return output
    reads.leaves.update(part[1] for part in tensor_leaves(form))  # lists and dicts: read whole
    return output


#: A reading model output's form, reads and fetch, by its id.
_OUTPUT_NOTES: dict[int, tuple[tuple, Reads, Callable[[int], Any] | None]] = {}
_reading_classes: dict[tuple[type, tuple[str, ...]], type] = {}
_classes_lock = threading.Lock()


def _field(output: Any, name: str) -> Any:
    return dict.__getitem__(output, name) if isinstance(output, dict) else object.__getattribute__(output, name)


def _set_field(output: Any, name: str, value: Any) -> None:
    if isinstance(output, dict):
        OrderedDict.__setitem__(output, name, value)
    object.__setattr__(output, name, value)


def _field_read(output: Any, name: str) -> None:
    notes = _OUTPUT_NOTES.get(id(output))
    if notes is None:
        return
    form, reads, fetch = notes
    for field, item in form[2]:
        if field != name:
            continue
        if item[0] == "tensor":
            reads.leaves.add(item[1])
            current = _field(output, name)
            if isinstance(current, Deferred):  # a hit's: fetched where the encode reads it, in its mode
                _set_field(output, name, current._fetch())
        elif item[0] == "object":
            reads.leaves.add(item[1])
            if fetch is not None and _field(output, name) is _ABSENT:
                _set_field(output, name, fetch(item[1]))
        elif item[0] == "tuple":
            handed = reads.tuples.get(id(_field(output, name)))
            if handed is not None:
                handed[1] = True
        else:
            reads.leaves.update(part[1] for part in tensor_leaves(item))


def _reading_class(kind: type, names: tuple[str, ...]) -> type:
    """Return the subclass of an output class whose field reads are noted (and absent objects fetched)."""
    found = _reading_classes.get((kind, names))
    if found is not None:
        return found
    fields = set(names)

    def __getattribute__(self: Any, name: str) -> Any:
        if name in fields:
            _field_read(self, name)
        return kind.__getattribute__(self, name)

    def __getitem__(self: Any, key: Any) -> Any:
        # By the ordered dict itself: ModelOutput's own __getitem__ goes through items(), which comes back here.
        if isinstance(key, str):
            _field_read(self, key)
            return dict.__getitem__(self, key)
        names = list(dict.keys(self))
        chosen = names[key] if isinstance(key, slice) else [names[key]]
        for name in chosen:
            _field_read(self, name)
        found = tuple(dict.__getitem__(self, name) for name in chosen)
        return found if isinstance(key, slice) else found[0]

    def __del__(self: Any) -> None:
        _OUTPUT_NOTES.pop(id(self), None)

    def to_tuple(self: Any) -> tuple:
        return tuple(self[name] for name in dict.keys(self))

    def values(self: Any) -> Any:
        return [self[name] for name in dict.keys(self)]

    def items(self: Any) -> Any:
        return [(name, self[name]) for name in dict.keys(self)]

    namespace: dict[str, Any] = {
        "__getattribute__": __getattribute__,
        "__del__": __del__,
        "_plain_class": kind,
        "__module__": kind.__module__,
        "__qualname__": kind.__qualname__,
    }
    if issubclass(kind, dict):  # a ModelOutput: read by key and position too
        namespace.update(__getitem__=__getitem__, to_tuple=to_tuple, values=values, items=items)
    with _classes_lock:
        found = _reading_classes.get((kind, names))
        if found is None:
            found = _reading_classes[(kind, names)] = type(kind.__name__, (kind,), namespace)
    return found


# --- What an entry keeps, and what a hit hands back --------------------------------------------------------------


class Deferred(torch.Tensor):
    """A tensor of an encoder output that its entry does not keep: its shape, dtype and device are known; anything
    else asked of it runs the encoder for real (once per output) and answers from the real tensor."""

    _fetch: Callable[[], torch.Tensor]

    @staticmethod
    def __new__(cls, shape: tuple, dtype: torch.dtype, device: torch.device, fetch: Callable[[], torch.Tensor]) -> Any:
        made = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        made._fetch = fetch
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return func(*_fetched(args), **_fetched(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise RuntimeError(f"a deferred encoder output reached {func} without being fetched")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return repr(self._fetch())


def _fetched(value: Any) -> Any:
    """Return ``value`` with each :class:`Deferred` in it fetched (tuples of any class, lists and dicts walked)."""
    if isinstance(value, Deferred):
        return value._fetch()
    if isinstance(value, tuple):
        return tuple(_fetched(item) for item in tuple.__iter__(value))
    if isinstance(value, list):
        return [_fetched(item) for item in value]
    if isinstance(value, dict):
        return {key: _fetched(item) for key, item in value.items()}
    return value


_METADATA = {
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.__len__,
    torch.Tensor.is_floating_point,
}

_ABSENT = object()  # a model output's field an entry does not keep, until it is fetched


def served(value: tuple, device: torch.device | None, fetch: Callable[[int], Any]) -> Any:
    """Return the output an entry's ``value`` stands for, on ``device`` (None: where its tensors are): each kept
    tensor a fresh copy (what the caller does to it never reaches the entry), every other leaf fetched on use by
    ``fetch(index)``."""
    _, form, stored = value
    return _builder(form)(stored, device, fetch)


Build = Callable[[tuple, "torch.device | None", Callable[[int], Any]], Any]


@functools.lru_cache(maxsize=1024)
def _builder(spelled_form: str) -> Build:
    """Return the function that rebuilds outputs of one form from an entry's leaves (made once per form: a hit
    walks no form)."""
    return _build(form_of(spelled_form))


def _build(form: tuple) -> Build:
    tag = form[0]
    if tag == "tensor":
        index, shape, dtype = form[1], torch.Size(form[2]), getattr(torch, form[3])

        def tensor(stored: tuple, device: torch.device | None, fetch: Callable[[int], Any]) -> Any:
            leaf = stored[index]
            if type(leaf) is Joined:  # made whole: a new tensor already
                leaf = whole(leaf)
                return leaf if device is None or leaf.device == device else leaf.to(device)
            if leaf is not None:
                return leaf.clone() if device is None or leaf.device == device else leaf.to(device, copy=True)
            where = device if device is not None else _any_device(stored)
            return Deferred(shape, dtype, where, lambda: fetch(index))

        return tensor
    if tag in ("none", "value"):
        plain = form[1] if tag == "value" else None
        return lambda stored, device, fetch: plain
    if tag in ("tuple", "list"):
        parts = tuple(_build(item) for item in form[1])
        if tag == "list":
            return lambda stored, device, fetch: [part(stored, device, fetch) for part in parts]

        def items(stored: tuple, device: torch.device | None, fetch: Callable[[int], Any]) -> tuple:
            made = tuple(part(stored, device, fetch) for part in parts)
            return FetchingTuple(made) if any(type(item) is Deferred for item in made) else made

        return items
    if tag == "dict":
        named = tuple((key, _build(item)) for key, item in form[1])
        return lambda stored, device, fetch: {key: part(stored, device, fetch) for key, part in named}
    if tag == "output":
        return _OutputBuilder(form)
    raise ValueError(f"an entry's form holds {tag!r} where no leaf may be")


class _OutputBuilder:
    """Rebuilds a model output of one form. A ``ModelOutput`` is built by its ``__init__`` until one built by setting
    its fields directly (no ``__post_init__``: a tenth of the cost) was seen to come out the same."""

    def __init__(self, form: tuple) -> None:
        module, _, name = form[1].partition(":")
        kind: Any = importlib.import_module(module)
        for part in name.split("."):
            kind = getattr(kind, part)
        self.kind, self.form = kind, form
        self.names = tuple(field for field, _ in form[2])
        self.parts = tuple((field, None if item[0] == "object" else _build(item)) for field, item in form[2])
        self.attributes = form[3:] == (ATTRIBUTES,)
        self.declared = (
            tuple(field.name for field in dataclasses.fields(kind)) if dataclasses.is_dataclass(kind) else ()
        )
        self.direct: bool | None = None if self.declared and not self.attributes else False

    def __call__(self, stored: tuple, device: torch.device | None, fetch: Callable[[int], Any]) -> Any:
        fields = [(field, _ABSENT if part is None else part(stored, device, fetch)) for field, part in self.parts]
        if self.attributes:  # its attributes set as they were: its __init__ may compute
            output = object.__new__(self.kind)
            for field, value in fields:
                object.__setattr__(output, field, value)
        elif self.direct:
            output = self._set_directly(fields)
        else:
            output = self._initialized(fields)
            if self.direct is None:
                self.direct = _same_output(output, self._set_directly(fields))
        if not any(value is _ABSENT or type(value) is Deferred for _, value in fields):
            return output
        object.__setattr__(output, "__class__", _reading_class(self.kind, self.names))
        _OUTPUT_NOTES[id(output)] = (self.form, Reads(), fetch)
        return output

    def _initialized(self, fields: list[tuple[str, Any]]) -> Any:
        output = self.kind(**{field: value for field, value in fields if value is not _ABSENT})
        for field, value in fields:  # in its place, so that positions and keys are the real output's
            if value is _ABSENT:
                _set_field(output, field, _ABSENT)
        _reorder(output, list(self.names))
        return output

    def _set_directly(self, fields: list[tuple[str, Any]]) -> Any:
        output = self.kind.__new__(self.kind)
        for field in self.declared:
            object.__setattr__(output, field, None)
        for field, value in fields:
            _set_field(output, field, value)
        return output


def _same_output(built: Any, direct: Any) -> bool:
    """Whether two rebuilt outputs hold the same objects, under the same keys in the same order (the ordered dict's,
    which code iterating an output sees), as attributes too."""
    return (
        type(built) is type(direct)
        and list(OrderedDict.keys(built)) == list(OrderedDict.keys(direct))
        and all(dict.__getitem__(built, key) is dict.__getitem__(direct, key) for key in OrderedDict.keys(built))
        and vars(built).keys() == vars(direct).keys()
        and all(value is vars(direct)[name] for name, value in vars(built).items())
    )


class FetchingTuple(tuple):
    """A hit's tuple holding tensors its entry does not keep (``hidden_states``): an item read from Python is fetched
    there, in the encode's own mode, so the encode gets a plain tensor; one C code reads in place (``torch.stack``)
    is a :class:`Deferred` that fetches itself."""

    __slots__ = ()

    def __getitem__(self, index: Any) -> Any:
        item = tuple.__getitem__(self, index)
        if isinstance(index, slice):
            return tuple(part._fetch() if isinstance(part, Deferred) else part for part in item)
        return item._fetch() if isinstance(item, Deferred) else item

    def __iter__(self) -> Iterator[Any]:
        return (part._fetch() if isinstance(part, Deferred) else part for part in tuple.__iter__(self))


def _reorder(output: Any, order: list[str]) -> None:
    for field in order:
        OrderedDict.move_to_end(output, field)


def _any_device(stored: tuple) -> torch.device:
    return next((leaf.device for leaf in stored if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
