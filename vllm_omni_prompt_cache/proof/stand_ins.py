"""What answers a text-encoder call in a proof run, and what watches the run while it is answered.

A hit is proven over the whole encode (see :mod:`.encoder_gate`): the method runs again with each
encoder call answered by a **stand-in**, a value of the structure the encoder returned when the entry
was made (the same types, tensor shapes and dtypes) filled with deterministic pseudo-random numbers,
different for each tensor. What the code after the encoder does with it (a layer chosen, tokens
dropped, a scale, a second encoder's output mixed in) shows in the run's result, which is compared
with the result of the same stand-ins when the entry was made.

While a run is answered, a :class:`ProofGuard` (a torch function mode) watches every torch call:

* a random draw is undone and stops the run (``randn_like`` on the output, ``normal_``, dropout): each call
  of a random function, or handed a generator of its own (the pipeline's, a helper's), is run with the
  generators it could draw from compared before and after, and set back; the method is not cached, since a
  hit would skip the draw a miss makes;
* every stand-in tensor, and every tensor computed from one, is noted (weakly); one still alive after the
  run that the result does not hold was kept somewhere (a helper, a global, an argument): stand-in data
  would stay behind, so the method is not cached.

Nothing here knows about vLLM-Omni or the cache's store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily

#: A structure part the stand-in leaves out (an encoder's KV cache object, say): answered with None.
OPAQUE = "opaque"


class Draws(BaseException):
    """Raised out of a proof run at a random draw, undone: a hit would skip the draw a miss makes. A
    BaseException, so that no handler of encoder failures takes it."""


def structure_of(value: Any) -> Any:
    """Return a JSON-able description of an encoder's output: what a stand-in of it is built from."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype).removeprefix("torch."), list(value.shape), str(value.device)]
    if value is None or type(value) in (bool, int, float, str):
        return ["value", value]
    if type(value) in (tuple, list):
        return [type(value).__name__, [structure_of(item) for item in value]]
    if isinstance(value, dict):  # a plain dict, or a transformers ModelOutput (an OrderedDict dataclass)
        items = [[str(key), structure_of(item)] for key, item in value.items()]
        if type(value) is dict:
            return ["dict", items]
        return ["mapping", f"{type(value).__module__}:{type(value).__qualname__}", items]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return ["named", f"{type(value).__module__}:{type(value).__qualname__}", [structure_of(v) for v in value]]
    if _plain_object(value):  # a SimpleNamespace, a dataclass, an output container of the model's own
        items = [[name, structure_of(item)] for name, item in vars(value).items()]
        return ["object", f"{type(value).__module__}:{type(value).__qualname__}", items]
    return [OPAQUE, type(value).__qualname__]


#: Output structures by their spelling: the encodes and records of prompts whose encoder outputs have one shape share
#: one, and with it the stand-in numbers a pipeline keeps for it (see :class:`StandIns`). Emptied when full.
_structures: dict[str, Any] = {}


def interned(structure: Any) -> Any:
    """Return the one structure equal to ``structure`` this process holds (``structure`` itself, the first time)."""
    spelled = json.dumps(structure, separators=(",", ":"))
    if len(_structures) >= 4096:
        _structures.clear()
    return _structures.setdefault(spelled, structure)


def _plain_object(value: Any) -> bool:
    """Return True for an object that is its data: made by ``object.__new__``, with a ``__dict__`` of tensors, numbers,
    strings and containers of them (an output container such as vLLM-Omni's ``MistralEncoderOutput``; not a KV cache
    object, whose layers are objects)."""
    kind = type(value)
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, (torch.nn.Module, type))
        and kind.__new__ in (object.__new__, types.SimpleNamespace.__new__)
        and not callable(value)
        and all(_data_only(item) for item in vars(value).values())
    )


def _data_only(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor) or value is None or type(value) in (bool, int, float, str):
        return True
    if depth < 8 and type(value) in (tuple, list):
        return all(_data_only(item, depth + 1) for item in value)
    if depth < 8 and type(value) is dict:
        return all(_data_only(item, depth + 1) for item in value.values())
    return False


def _seed(path: str) -> int:
    return int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def _class(spelled: str) -> type:
    """Return the class a structure names, from a module this process imported already (an entry read from a shared
    directory names it: nothing is imported for it)."""
    module, _, qualname = spelled.partition(":")
    found: Any = sys.modules[module]
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


#: A stand-in's strides, from its last dimension back: small, so that a large stand-in is a view of a few thousand
#: numbers (an encoder's hidden states for every layer would cost as much memory as the encoder's own output), yet
#: every element along each dimension differs from its neighbours.
_STRIDES = (1, 3, 17, 71, 257, 1031, 4099)
#: At most this many elements, a stand-in is made whole.
_WHOLE = 4096


def _tensor(dtype_name: str, shape: list[int], device_name: str, generator_of: Any, near: torch.device | None) -> _Made:
    dtype = getattr(torch, dtype_name)
    device = torch.device(device_name)
    if near is not None and near.type == device.type:
        device = near  # where this call's inputs are (another rank's GPU than the one that made the entry)
    elif device.type != "cpu" and not getattr(torch, device.type).is_available():
        device = torch.device("cpu")  # an entry made on another machine: the run compares nothing device-bound
    generator = generator_of(device)
    numel = 1
    for size in shape:
        numel *= size
    if numel <= _WHOLE or len(shape) > len(_STRIDES):
        sizes, strides = list(shape), None
    else:  # a view of a short vector: each element is base[sum(index * stride)]
        strides = list(reversed(_STRIDES[: len(shape)]))
        sizes = [1 + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))] if shape else []
    if dtype.is_floating_point or dtype.is_complex:  # both signs, beyond 1: a relu, an abs or a clamp shows
        base = ((torch.rand(sizes, generator=generator, device=device, dtype=torch.float32) * 2 - 1) * 4).to(dtype)
    elif dtype is torch.bool:
        base = torch.rand(sizes, generator=generator, device=device, dtype=torch.float32) < 0.5
    else:
        low = -1000 if torch.iinfo(dtype).min < 0 else 0
        base = torch.randint(low, 1000, sizes, generator=generator, device=device, dtype=dtype)
    return _Made(base, list(shape), strides)


class _Made(NamedTuple):
    """One stand-in tensor's numbers: ``base`` is never handed out; each run gets a view of its own copy."""

    base: torch.Tensor
    shape: list[int]
    strides: list[int] | None

    def handed_out(self) -> torch.Tensor:
        """Return a new tensor of these numbers: a copy of ``base`` (a few thousand numbers), viewed as recorded. A
        copy, not a view of ``base``: no write a run makes (in place, through ``.data``, a kernel given its pointer)
        can reach the numbers a later run or the reference digest starts from."""
        copy = self.base.clone()
        if copy.is_cuda:  # read on this stream: not reused before the copy is made, if dropped meanwhile
            self.base.record_stream(torch.cuda.current_stream(copy.device))
        return copy.view(self.shape) if self.strides is None else copy.as_strided(self.shape, self.strides)


#: At most this many stand-ins' numbers are kept by a pipeline's gate (each a few thousand numbers a tensor).
_KEPT = 64


class StandIns:
    """The stand-ins of one pipeline's proof runs: the numbers of the last :data:`_KEPT` used (by output structure,
    call index and device) are kept on their device while the pipeline lives, and every run is handed copies."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[int, str, Any], tuple[Any, list[_Made]]] = OrderedDict()
        self._lock = threading.Lock()

    def make(self, structure: Any, path: str, near: torch.device | None, guard: ProofGuard | None = None) -> Any:
        """Return :func:`stand_in`'s value for these arguments, its numbers made once; noted by ``guard``."""
        key = (id(structure), path, near)
        with self._lock:
            found = self._kept.get(key)
            if found is not None and found[0] is structure:  # held here, so its id is no other structure's
                self._kept.move_to_end(key)
        if found is not None and found[0] is structure:
            copies = iter([made.handed_out() for made in found[1]])
            value = _made(structure, lambda *_: next(copies), near)
        else:
            numbers: list[_Made] = []
            value = _stand_in(structure, path, near, numbers)
            for device in {made.base.device for made in numbers if made.base.is_cuda}:
                torch.cuda.current_stream(device).synchronize()  # made before another thread's stream copies them
            with self._lock:
                self._kept[key] = (structure, numbers)
                if len(self._kept) > _KEPT:
                    self._kept.popitem(last=False)
        if guard is not None:
            guard.plant(value)
        return value


def stand_in(structure: Any, path: str = "", near: torch.device | None = None) -> Any:
    """Return a value of ``structure`` (see :func:`structure_of`) filled with numbers seeded by ``path``: the same
    structure and path give the same values, each tensor its own, of both signs. Tensors of more than a few thousand
    elements are views of a short vector (see ``_STRIDES``). ``near``: the device of the call's inputs, used for
    tensors recorded on a device of its type. (:class:`StandIns` keeps the numbers for later runs.)"""
    return _stand_in(structure, path, near, [])


def _stand_in(structure: Any, path: str, near: torch.device | None, numbers: list[_Made]) -> Any:
    """Make :func:`stand_in`'s value, noting each tensor's numbers in ``numbers`` (the value holds copies of them)."""
    generators: dict[torch.device, torch.Generator] = {}

    def generator_of(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(_seed(f"{path}@{device.type}"))
        return generators[device]

    def tensor(*spelled: Any) -> torch.Tensor:
        numbers.append(_tensor(*spelled, generator_of, near))
        return numbers[-1].handed_out()

    return _made(structure, tensor, near)


def _made(structure: Any, tensor: Any, near: torch.device | None) -> Any:
    """Return the value ``structure`` describes, each tensor from ``tensor(dtype, shape, device)``."""
    kind = structure[0]
    if kind == "tensor":
        return tensor(structure[1], structure[2], structure[3])
    if kind == "value":
        return structure[1]
    if kind in ("tuple", "list"):
        items = [_made(item, tensor, near) for item in structure[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {key: _made(item, tensor, near) for key, item in structure[1]}
    if kind == "mapping":
        return _class(structure[1])(**{key: _made(item, tensor, near) for key, item in structure[2]})
    if kind == "named":
        return _class(structure[1])(*(_made(item, tensor, near) for item in structure[2]))
    if kind == "object":  # a plain object: its attributes set as they were, no constructor run
        made_class = _class(structure[1])
        made = made_class.__new__(made_class)
        made.__dict__.update({name: _made(item, tensor, near) for name, item in structure[2]})
        return made
    return None  # OPAQUE


def tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Yield the tensors ``value`` holds (in tuples, lists, dicts), and the bases of views among them."""
    if depth > 32:
        return
    if isinstance(value, torch.Tensor):
        yield value
        if value._base is not None:
            yield value._base
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth + 1)


class ProofGuard(TorchFunctionMode):
    """Watches one proof run's torch calls, on its own thread (a function mode: a fraction of a dispatch mode's cost
    per call): a random draw is undone and stops the run (:class:`Draws`), and the tensors computed from stand-ins
    are noted (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.tainted = _Tensors()
        self.watching = True  # False once the run goes on through a real encoder: it is a miss's encode then
        self.draw: str | None = None  # the draw that stopped the run (also when the run's code caught Draws)

    def plant(self, value: Any) -> None:
        """Note the tensors of ``value``, a stand-in, as stand-in data."""
        for tensor in tensors_in(value):
            self.tainted.add(tensor)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if not self.watching:
            return func(*args, **kwargs)
        try:
            kind = _KINDS.get(func)  # only torch's own functions are ever kept there (see _keeps)
        except TypeError:  # an unhashable callable
            kind = None
        if kind is None:
            kind = _kind_of(func)
            if _keeps(func):
                if len(_KINDS) > 4096:  # never in practice: torch has fewer functions
                    _KINDS.clear()
                _KINDS[func] = kind
        if kind & _DRAWS or (kwargs and kwargs.get("generator") is not None):
            output = self._without_drawing(func, args, kwargs, kwargs.get("generator"))
        else:
            output = func(*args, **kwargs)
        tainted = self.tainted
        if tainted.refs and _touches(args, kwargs, tainted.refs):
            if type(output) is torch.Tensor:
                tainted.add(output)
            elif isinstance(output, (tuple, list)):
                for tensor in tensors_in(output):
                    tainted.add(tensor)
            if kind & _IN_PLACE or "out" in kwargs:
                for argument in (args[:1] if args else ()) + ((kwargs["out"],) if "out" in kwargs else ()):
                    for tensor in tensors_in(argument):
                        tainted.add(tensor)
        return output

    def _without_drawing(self, func: Any, args: tuple, kwargs: dict, generator: Any) -> Any:
        """Run a call that may draw (a random function, one handed a generator); when it drew, set the generators it
        could have drawn from back and raise :class:`Draws`. Only this call's window is watched: another thread's
        draw at that instant is the one risk, which refuses the method, never serves it."""
        generators = [generator] if isinstance(generator, torch.Generator) else []
        generators.append(torch.default_generator)
        device = next((value.device for value in args if isinstance(value, torch.Tensor)), None)
        if device is not None and device.type == "cuda":
            generators.append(torch.cuda.default_generators[device.index or 0])
        states = [each.get_state() for each in generators]
        output = func(*args, **kwargs)
        for each, state in zip(generators, states, strict=True):
            if not torch.equal(each.get_state(), state):
                for again, kept in zip(generators, states, strict=True):
                    again.set_state(kept)
                self.draw = getattr(func, "__name__", str(func))
                raise Draws(self.draw)
        return output

    def left_behind(self, result: Any) -> int:
        """Return how many tensors computed from stand-ins are still alive outside ``result`` (and the stand-ins)."""
        held = {id(tensor) for tensor in tensors_in(result)}
        return sum(1 for key in self.tainted.alive() if key not in held)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run the block (a real encoder's forward, a stand-in's making) without this guard on the mode stack."""
        if _get_current_function_mode() is self:
            with _pop_mode_temporarily():
                yield
            return
        watching, self.watching = self.watching, False
        try:
            yield
        finally:
            self.watching = watching


#: What a torch function may do that a proof run watches (bits): draw random numbers; write into its first argument.
_DRAWS, _IN_PLACE = 1, 2
#: Each torch function met, by itself: its bits, looked up once per process for the kinds of callable torch's own
#: functions are (builtins, descriptors, ops, functions without a closure: they live as long as torch); a closure or
#: a bound method handed to the mode is looked at every time, and not kept alive here.
_KINDS: dict[Any, int] = {}
_STABLE = frozenset(
    type(each)
    for each in (torch.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.shape.__get__, torch.Tensor.add)
) | {torch._ops.OpOverload, torch._ops.OpOverloadPacket}
_FUNCTION = types.FunctionType  # (``types`` is an argument's name in ``__torch_function__``)


def _keeps(func: Any) -> bool:
    """Return True for a callable :data:`_KINDS` may keep: one of torch's own kinds, bound to no tensor (``x.add`` is
    not kept, nor its tensor with it)."""
    stable = type(func) in _STABLE or (type(func) is _FUNCTION and func.__closure__ is None)
    return stable and not isinstance(getattr(func, "__self__", None), torch.Tensor)


def _kind_of(func: Any) -> int:
    name = getattr(func, "__name__", "")
    random = False
    with contextlib.suppress(TypeError):  # an unhashable callable: none of torch's random functions
        random = func in _RANDOM
    return (_DRAWS if random else 0) | (_IN_PLACE if type(name) is str and _writes_in_place(name) else 0)


def _writes_in_place(name: str) -> bool:
    """Return True for a function that writes into its first argument: ``add_``, ``x[i] = v``, ``x += v``; not other
    dunders (``__getitem__`` reads: a real tensor indexed by a stand-in stays real); ``out`` is checked per call."""
    if name.startswith("__"):
        return name in _IN_PLACE_DUNDERS
    return name[-1:] == "_"


_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "div", "mod", "pow", "and", "or", "xor")
) | {"__ilshift__", "__irshift__", "__setitem__"}


def _random_functions() -> frozenset[Any]:
    """Return the torch functions and tensor methods that draw random numbers (a dropout when training, an attention
    with ``dropout_p``): what a proof run checks for draws."""
    named: dict[Any, tuple[str, ...]] = {
        torch: (
            *("rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "normal"),
            *("bernoulli", "multinomial", "poisson", "binomial", "dropout", "native_dropout", "alpha_dropout"),
            *("feature_alpha_dropout", "rrelu"),
        ),
        torch.Tensor: (
            *("normal_", "uniform_", "bernoulli", "bernoulli_", "random_", "exponential_", "geometric_"),
            *("log_normal_", "cauchy_", "multinomial"),
        ),
        torch.nn.functional: (
            *("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "rrelu"),
            *("gumbel_softmax", "scaled_dot_product_attention"),
        ),
    }
    return frozenset(getattr(owner, name) for owner, names in named.items() for name in names if hasattr(owner, name))


_RANDOM = _random_functions()


class _Tensors:
    """A set of live tensors by identity (a WeakSet would compare tensors with ``==``, element by element)."""

    def __init__(self) -> None:
        self.refs: dict[int, weakref.ref[torch.Tensor]] = {}  # read directly on every torch call (see _touches)

    def add(self, tensor: torch.Tensor) -> None:
        self.refs[id(tensor)] = weakref.ref(tensor)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        ref = self.refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def alive(self) -> list[int]:
        return [key for key, ref in list(self.refs.items()) if ref() is not None]


def _touches(args: tuple, kwargs: dict, refs: dict[int, weakref.ref[torch.Tensor]]) -> bool:
    """Return True when a torch call is handed a tensor in ``refs`` (the live stand-in data, by id), itself or in a
    tuple or list."""
    for argument in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(argument, torch.Tensor):
            ref = refs.get(id(argument))
            if ref is not None and ref() is argument:
                return True
        elif isinstance(argument, (tuple, list)):
            for item in argument:
                if isinstance(item, torch.Tensor):
                    ref = refs.get(id(item))
                    if ref is not None and ref() is item:
                        return True
    return False
