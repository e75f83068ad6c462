"""Which replica a request goes to: prompt-affinity keys and consistent hashing with bounded loads.

Each replica of a diffusion stage keeps its own cache, so the K siblings of a prompt hit only if
they reach the same replica. :func:`prompt_affinity_key` names a request's prompt content (token
ids or text, the negative prompt, media the text encoder reads) with the canonical encoding the
cache keys use, so siblings agree with each other and with the cache. :class:`BoundedLoadRing`
maps keys to replicas by consistent hashing with bounded loads (Mirrokni, Thorup and
Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018): a key goes to the first
replica clockwise from it on a ring whose in-flight load stays within
``ceil((1 + epsilon) * mean)``, the mean counting the request being placed. Adding or removing a
replica moves only the keys whose first choice it is or was. :class:`PromptAffinityRouter` adds
what a ring alone lacks when siblings arrive together: a prompt whose first request spilled keeps
going where its siblings already are (while that replica is within the bound), and a request with
no prompt content goes to the least-loaded replica, counted with its reason.

A digest collision here costs only a shared route, never a wrong embedding: the cache verifies its
own keys. Nothing here knows about vLLM-Omni.
"""

from __future__ import annotations

import bisect
import math
import os
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash

from vllm_omni_prompt_cache.keys.call_key import Bypass, value_identity
from vllm_omni_prompt_cache.settings.schema import PromptEmbedCacheConfigError

#: Request fields that decide what the text encoder sees, in key order. The two spellings of token
#: ids share a slot, so an adapter's ``prompt_ids`` and vLLM's ``prompt_token_ids`` agree.
PROMPT_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("prompt_tokens", ("prompt_ids", "prompt_token_ids")),
    ("prompt", ("prompt",)),
    ("negative_tokens", ("negative_prompt_ids", "negative_prompt_token_ids")),
    ("negative_prompt", ("negative_prompt",)),
    ("media", ("multi_modal_data",)),
)
_TOKEN_SLOTS = frozenset({"prompt_tokens", "negative_tokens"})
_POSITIVE_SLOTS = frozenset({"prompt_tokens", "prompt", "media"})

#: How far above the mean in-flight load a replica may go: ``ceil((1 + epsilon) * mean)``.
DEFAULT_EPSILON = 0.25
EPSILON_ENV = "VLLM_OMNI_PROMPT_AFFINITY_EPSILON"
#: Points per replica on the ring. More points spread keys more evenly: at 160, the largest share of
#: a 64-replica ring was 1.18-1.25x the mean here. A ring is placed (~7 ms at 64 replicas) once per
#: set of replicas.
VIRTUAL_NODES = 160


class UnroutableRequest(ValueError):
    """A request carries no prompt content to route by; ``reason`` says what was missing or wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def prompt_affinity_key(request: Any) -> str:
    """Return a stable hex digest of ``request``'s prompt content; raise UnroutableRequest if it has none.

    ``request`` is what a client sends: a prompt string, or a mapping (or object) with any of
    ``prompt``, ``prompt_ids`` / ``prompt_token_ids``, ``negative_prompt``,
    ``negative_prompt_ids`` / ``negative_prompt_token_ids`` and ``multi_modal_data``. Token ids
    count by value (a list, numpy array or tensor of the same ids is one key, wherever the tensor
    lives); seeds, request ids and sampling settings never enter. The digest is the same in every
    process and on every machine.
    """
    fields = {"prompt": request} if isinstance(request, str) else _prompt_fields(request)
    parts = []
    for slot, names in PROMPT_FIELDS:
        value = next((fields[name] for name in names if fields.get(name) is not None), None)
        if value is None:
            continue
        identity = value_identity(_token_array(value, slot) if slot in _TOKEN_SLOTS else value)
        if type(identity) is Bypass:
            raise UnroutableRequest(f"{slot} cannot be keyed: {identity.reason}")
        parts.append((slot, identity))
    if not any(slot in _POSITIVE_SLOTS for slot, _ in parts):
        # A negative prompt alone (say, beside prompt_embeds) is shared by unrelated requests.
        names = ", ".join(name for slot, names in PROMPT_FIELDS if slot in _POSITIVE_SLOTS for name in names)
        raise UnroutableRequest(f"no prompt content (none of {names})")
    # repr of these tuples (str, int, bytes, dtype and shape tags) is the same in every process.
    return xxhash.xxh3_128_hexdigest(repr(tuple(parts)).encode())


def _prompt_fields(request: Any) -> Mapping[str, Any]:
    if isinstance(request, Mapping):
        return request
    if isinstance(request, (list, tuple)):
        raise UnroutableRequest(f"a {type(request).__name__} of prompts is not one request")
    return {name: getattr(request, name, None) for _, names in PROMPT_FIELDS for name in names}


def _token_array(value: Any, slot: str) -> np.ndarray:
    """Return token ids as one int64 row, whatever container, device or leading batch of one holds them."""
    try:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() or value.is_complex():
                raise UnroutableRequest(f"{slot} are not integers (dtype {value.dtype})")
            value = value.detach().cpu().numpy()
        array = np.asarray(value)
    except UnroutableRequest:
        raise
    except Exception as error:  # meta or exotic tensors, ragged lists, objects that refuse
        raise UnroutableRequest(f"{slot} are not an array of integers ({type(error).__name__})") from None
    if array.dtype.kind not in "iub":
        raise UnroutableRequest(f"{slot} are not integers (dtype {array.dtype})")
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    return np.ascontiguousarray(array, dtype=np.int64)


def epsilon_from_env(environ: Mapping[str, str] | None = None) -> float:
    """Return the load slack from :data:`EPSILON_ENV`, or the default; raise naming the variable if malformed."""
    environ = os.environ if environ is None else environ
    if EPSILON_ENV not in environ:
        return DEFAULT_EPSILON
    return check_epsilon(environ[EPSILON_ENV], f"environment variable {EPSILON_ENV}")


def check_epsilon(value: Any, source: str) -> float:
    """Return ``value`` as a load slack; raise naming ``source`` unless it is a finite number >= 0."""
    try:
        epsilon = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        epsilon = math.nan
    if isinstance(value, bool) or not math.isfinite(epsilon) or epsilon < 0:
        raise PromptEmbedCacheConfigError(
            f"invalid prompt-affinity load slack {value!r} from {source}: expected a finite number >= 0 "
            f"(a replica may take ceil((1 + epsilon) * mean in-flight load); default {DEFAULT_EPSILON})"
        )
    return epsilon


def _position(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode())


class Placement(NamedTuple):
    """Where the ring put a key: the replica's index, and whether it is the key's first choice."""

    index: int
    at_home: bool


class BoundedLoadRing:
    """Consistent hashing with bounded loads over replicas named by stable strings.

    Not thread-safe: callers that route from several threads hold a lock around it.
    """

    def __init__(self, *, epsilon: float = DEFAULT_EPSILON, virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.epsilon = check_epsilon(epsilon, "BoundedLoadRing(epsilon=...)")
        # The decimal the user wrote (0.1, not the binary float nearest it), so bounds are exact.
        self._exact_epsilon = Fraction(repr(self.epsilon))
        if isinstance(virtual_nodes, bool) or not isinstance(virtual_nodes, int) or virtual_nodes < 1:
            raise ValueError(f"invalid virtual_nodes={virtual_nodes!r}: expected an integer >= 1")
        self.virtual_nodes = virtual_nodes
        self._members: frozenset[str] = frozenset()
        self._positions: list[int] = []  # sorted ring points
        self._owners: list[str] = []  # the replica at each point

    def capacity(self, total_load: int, replica_count: int) -> int:
        """Return the most in-flight requests one replica may hold once ``total_load`` are placed.

        ``ceil((1 + epsilon) * total_load / replica_count)``, exactly: at least the mean rounded up,
        so some replica always has room.
        """
        return math.ceil((1 + self._exact_epsilon) * total_load / replica_count)

    def choose(self, key: str, replicas: Sequence[str], loads: Sequence[int]) -> int:
        """Return the index in ``replicas`` that ``key`` goes to, given each replica's in-flight load.

        The first replica clockwise from the key whose load stays within :meth:`capacity` once this
        request is added; with ``epsilon`` large enough that is always the key's home replica.
        """
        return self.place(key, replicas, loads).index

    def place(self, key: str, replicas: Sequence[str], loads: Sequence[int]) -> Placement:
        """Return where :meth:`choose` sends ``key``, and whether that is its home replica (one walk)."""
        if not replicas:
            raise ValueError("replicas must not be empty")
        if len(loads) != len(replicas):
            raise ValueError(f"{len(loads)} loads for {len(replicas)} replicas")
        if any(load < 0 for load in loads):
            raise ValueError(f"loads must be >= 0, got {list(loads)}")
        self._place(replicas)
        index_of = {name: index for index, name in enumerate(replicas)}
        limit = self.capacity(sum(loads) + 1, len(replicas))
        point = bisect.bisect_left(self._positions, _position(key))
        seen: set[str] = set()
        for step in range(len(self._positions)):
            owner = self._owners[(point + step) % len(self._owners)]
            if owner in seen:
                continue
            index = index_of[owner]
            if loads[index] < limit:
                return Placement(index, at_home=not seen)
            seen.add(owner)
            if len(seen) == len(replicas):
                break
        raise AssertionError("no replica under the load bound")  # capacity() rules this out

    def home(self, key: str, replicas: Sequence[str]) -> int:
        """Return the index of ``key``'s first choice, ignoring loads."""
        return self.choose(key, replicas, [0] * len(replicas))

    def _place(self, replicas: Sequence[str]) -> None:
        members = frozenset(replicas)
        if len(members) != len(replicas):
            raise ValueError(f"replica names must be distinct, got {list(replicas)}")
        if members == self._members:
            return
        points = sorted((_position(f"{name}#{node}"), name) for name in members for node in range(self.virtual_nodes))
        self._positions = [position for position, _ in points]
        self._owners = [name for _, name in points]
        self._members = members


#: Prompts whose last placement a router remembers (LRU). An RL step has a few hundred distinct
#: prompts in flight; an entry costs about 200 bytes (120 for the entry, measured with tracemalloc,
#: and 80 for its key).
REMEMBERED_PROMPTS = 4096


class PromptAffinityRouter:
    """Routes requests by prompt-affinity key over a :class:`BoundedLoadRing`; counts how each was placed.

    A key goes to the least-loaded replica among those its siblings went to that is within the load
    bound (their cache is warm there), else to the ring's choice (home, or the next with room).
    ``None`` as the key (no prompt content) means the least-loaded replica. Not thread-safe, like
    the ring.
    """

    def __init__(
        self,
        *,
        epsilon: float = DEFAULT_EPSILON,
        virtual_nodes: int = VIRTUAL_NODES,
        remembered: int = REMEMBERED_PROMPTS,
    ) -> None:
        self.ring = BoundedLoadRing(epsilon=epsilon, virtual_nodes=virtual_nodes)
        self._remembered = remembered
        self._warm_replicas: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # key -> where it went
        self.placements: Counter[str] = Counter()  # home, with siblings, spilled, least-loaded
        self.fallback_reasons: Counter[str] = Counter()
        #: The fullest a chosen replica has been, as its load (this request included) over the bound.
        self.peak_load_over_bound = 0.0

    @property
    def epsilon(self) -> float:
        return self.ring.epsilon

    def route(self, key: str | None, replicas: Sequence[str], loads: Sequence[int], *, reason: str = "") -> int:
        """Return the index in ``replicas`` for a request with ``key`` (None: ``reason`` says why none)."""
        limit = self.ring.capacity(sum(loads) + 1, len(replicas))
        if key is None:
            self.placements["least-loaded"] += 1
            self.fallback_reasons[reason or "no key"] += 1
            index = least_loaded(loads)
            self._note_load(loads[index] + 1, limit)
            return index
        warm = self._warm_replicas.get(key, ())
        with_room = [index for index, name in enumerate(replicas) if name in warm and loads[index] < limit]
        if with_room:
            index = min(with_room, key=loads.__getitem__)
            self.placements["with siblings"] += 1
        else:
            index, at_home = self.ring.place(key, replicas, loads)
            self.placements["home" if at_home else "spilled"] += 1
        self._remember(key, replicas[index])
        self._note_load(loads[index] + 1, limit)
        return index

    def _note_load(self, load: int, limit: int) -> None:
        self.peak_load_over_bound = max(self.peak_load_over_bound, load / limit)

    def _remember(self, key: str, replica: str) -> None:
        warm = self._warm_replicas.pop(key, ())
        self._warm_replicas[key] = warm if replica in warm else (*warm, replica)  # most recent last
        if len(self._warm_replicas) > self._remembered:
            self._warm_replicas.popitem(last=False)


def least_loaded(loads: Sequence[int]) -> int:
    """Return the index of a least-loaded replica, ties broken at random (as vLLM-Omni's policy does)."""
    if not loads:
        raise ValueError("replicas must not be empty")
    fewest = min(loads)
    return random.choice([index for index, load in enumerate(loads) if load == fewest])
