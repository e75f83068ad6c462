"""Which of a pipeline's child modules are its text encoders: one answer for the watch, the fingerprint and offload.

A text encoder turns integer token ids into hidden states: it holds a **token table**, a table of vectors
looked up by integer id (an ``nn.Embedding``; vLLM's ``VocabParallelEmbedding`` and its kin, by their
``num_embeddings`` and ``embedding_dim``, a quantized one too, which holds ``weight_packed`` and no
``weight``; or a parameter seen fed integer ids through ``F.embedding`` while a method was watched). The
table is where the encoder's input enters: it is the input layer of the encoder (the layer
``get_input_embeddings()`` names, else its first layer holding weights), or of a part of it (a
vision-language encoder whose vision tower comes first, as vLLM-Omni's ``MiniMaxH3Qwen3VLEncoder``, holds
its language model's table deeper inside). Holding a table elsewhere is not enough: a DiT may keep a
small one for a condition (Qwen-Image's additional-t embedding, HunyuanVideo 1.5's condition type), and
an image encoder one for positions (CLIP's and SigLIP's vision towers, whose input layer is a patch
convolution). Attribute names play no part: a text encoder under ``prompt_tower`` is one, a connector
listed with the encoders is not.

:mod:`.discovery` watches the token tables of these modules, :mod:`.residency` and
:mod:`.vllm_omni.offload` move and count them. What the directory fingerprint hashes and what a weight load
empties the cache for are these and the encoders the pipeline declares itself (:func:`embedding_sources`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Parameters seen fed integer ids through ``F.embedding`` while a method was watched (see :func:`note_token_table`).
_observed_tables: dict[int, weakref.ref[torch.Tensor]] = {}
_tables_lock = threading.Lock()
#: How many token tables were recognised by watching so far (what the gate compares to look again).
TABLES_NOTED = [0]


def note_token_table(weight: torch.Tensor) -> bool:
    """Note ``weight`` as a token table (a parameter a watched encode looked up integer ids in); return True when
    it was not known."""
    key = id(weight)
    with _tables_lock:
        if key in _observed_tables and _observed_tables[key]() is weight:
            return False
        _observed_tables[key] = weakref.ref(weight, lambda _, key=key: _observed_tables.pop(key, None))
        TABLES_NOTED[0] += 1
        return True


def _holds_observed_table(module: torch.nn.Module) -> bool:
    if not _observed_tables:
        return False
    for value in module._parameters.values():
        ref = _observed_tables.get(id(value)) if value is not None else None
        if ref is not None and ref() is value:
            return True
    return False


def child_modules(pipeline: Any) -> dict[str, torch.nn.Module]:
    """Return the pipeline's direct child modules by attribute name (a torch module's children, each once under its
    first name, as ``named_children`` has them; else its attributes), read from one copy of what holds them."""
    once = isinstance(pipeline, torch.nn.Module)
    children: dict[str, torch.nn.Module] = {}
    for name, value in dict(modules_held_by(pipeline)).items():  # a copy: see modules_held_by
        if isinstance(value, torch.nn.Module) and not (once and any(value is child for child in children.values())):
            children[name] = value
    return children


def modules_held_by(pipeline: Any) -> Mapping[str, Any]:
    """Return the live mapping :func:`child_modules` finds the pipeline's children in (a torch module's ``_modules``,
    else the instance's attributes): comparing what it holds tells, without a walk, whether a child was replaced.
    Walk a copy, ``dict(held)``, made at once: another thread may add an attribute to the pipeline meanwhile, and a
    walk over the live mapping would then raise out of the user's call."""
    if isinstance(pipeline, torch.nn.Module):
        return pipeline._modules
    try:
        return vars(pipeline)
    except TypeError:
        return {}


def is_token_embedding(module: torch.nn.Module) -> bool:
    """Return True for a table of vectors looked up by integer id: an ``nn.Embedding``; a vocabulary-parallel one
    (vLLM's ``VocabParallelEmbedding`` and its kin: ``num_embeddings``, ``embedding_dim`` and a 2-D weight), or a
    quantized one (those two numbers and parameters, no ``weight``: compressed-tensors' ``weight_packed``); or a
    module holding a parameter seen fed integer ids through ``F.embedding`` (:func:`note_token_table`)."""
    if isinstance(module, torch.nn.Embedding):
        return True
    weight = module._parameters.get("weight")
    embedding_dim = getattr(module, "embedding_dim", None)
    if isinstance(getattr(module, "num_embeddings", None), int) and isinstance(embedding_dim, int):
        if isinstance(weight, torch.Tensor):
            return weight.dim() == 2 and weight.shape[1] == embedding_dim
        if "weight" not in module._parameters and any(value is not None for value in module._parameters.values()):
            return True
    return _holds_observed_table(module)


def input_layer(module: torch.nn.Module) -> torch.nn.Module | None:
    """Return the layer ``module``'s input enters: the one ``get_input_embeddings()`` returns where the module
    answers it (Hugging Face models), else its first layer holding weights of its own; None if it has none."""
    named = getattr(module, "get_input_embeddings", None)
    if callable(named):
        with contextlib.suppress(NotImplementedError, AttributeError, TypeError):  # declared but not implemented
            layer = named()
            if isinstance(layer, torch.nn.Module):
                return layer
    return next(
        (part for part in module.modules() if any(value is not None for value in part._parameters.values())), None
    )


def is_text_encoder(module: torch.nn.Module) -> bool:
    """Return True when ``module`` holds a token table that is its input layer or the input layer of a part of it
    (see the module docstring)."""
    layer = input_layer(module)
    if layer is not None and is_token_embedding(layer):
        return True
    # Deeper: a table that is the first weighted layer of its parent and followed there by more weighted layers (a
    # language model's table, then its decoder layers, after a vision tower); a table alone in its module (a DiT's
    # class-label table, a VQ codebook) or a small one (a condition type) is not where text enters.
    open_parts: list[list[Any]] = []  # each open ancestor: [weighted layer seen in it, a table came first in it]
    for part, depth in _preorder(module):
        del open_parts[depth:]
        owns = any(value is not None for value in part._parameters.values())
        if owns and any(table_first for _, table_first in open_parts[1:]):
            return True
        if owns and depth > 1 and not open_parts[-1][0] and is_token_embedding(part) and _rows(part) >= MIN_ROWS:
            open_parts[-1][1] = True
        if owns:
            for ancestor in open_parts:
                ancestor[0] = True
        open_parts.append([owns, False])
    return False


#: The fewest rows a table deeper in a module needs to be taken for a vocabulary (condition tables have a few).
MIN_ROWS = 64


def _rows(table: torch.nn.Module) -> int:
    rows = getattr(table, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    weight = next((value for value in table._parameters.values() if value is not None), None)
    return int(weight.shape[0]) if weight is not None and weight.dim() >= 1 else 0


def _preorder(module: torch.nn.Module, depth: int = 0) -> Any:
    """Yield ``(module, depth)`` for ``module`` and every module under it, parents before their children."""
    yield module, depth
    for child in module._modules.values():
        if child is not None:
            yield from _preorder(child, depth + 1)


def text_encoders(pipeline: Any) -> dict[str, torch.nn.Module]:
    """Return the pipeline's text encoders by attribute name: its child modules whose input is token ids."""
    return {name: module for name, module in child_modules(pipeline).items() if is_text_encoder(module)}


def token_embeddings(pipeline: Any) -> dict[str, list[torch.nn.Module]]:
    """Return the token embeddings inside each of the pipeline's text encoders, by encoder name (a CLIP encoder's
    position embedding too: it is fed integer ids as well)."""
    return {
        name: [part for part in module.modules() if is_token_embedding(part)]
        for name, module in text_encoders(pipeline).items()
    }


def embedding_sources(pipeline: Any) -> dict[str, torch.nn.Module]:
    """Return every module whose weights shape what the cache keeps, by attribute name: the text encoders, and
    the encoders the pipeline itself declares in ``_encoder_modules`` (vLLM-Omni's list, which may name an image
    encoder or a connector that a declared method runs). What the directory fingerprint covers, and what a
    weight load or a LoRA change on which empties the cache."""
    sources = text_encoders(pipeline)
    for name in getattr(pipeline, "_encoder_modules", None) or ():
        module = getattr(pipeline, name, None) if isinstance(name, str) else None
        if isinstance(module, torch.nn.Module):
            sources.setdefault(name, module)
    return sources


def paths_to_embeddings(name: str, module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Return ``(qualified name, module)`` for ``module`` and each module under it on the way to a token embedding."""
    on_the_way = {""}
    for path, part in module.named_modules(remove_duplicate=False):  # T5's embedding sits under two names
        if is_token_embedding(part):
            steps = path.split(".")
            on_the_way.update(".".join(steps[:depth]) for depth in range(1, len(steps) + 1))
    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for path, part in module.named_modules(remove_duplicate=False):
        if path in on_the_way and id(part) not in found:
            found[id(part)] = (f"{name}.{path}" if path else name, part)
    return list(found.values())


_EMBEDDING = torch.ops.aten.embedding.default


class _TablesNoted(TorchDispatchMode):
    """Notes each parameter looked up by integer ids (``F.embedding``): a token table, wherever it is held."""

    def __init__(self) -> None:
        super().__init__()
        self.noted = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if (
            func is _EMBEDDING
            and len(args) > 1
            and isinstance(args[0], torch.nn.Parameter)
            and not args[1].is_floating_point()
            and note_token_table(args[0])
        ):
            self.noted += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def noting_token_tables() -> Iterator[_TablesNoted]:
    """Note, for the block, every parameter fed integer ids (a method's first call: an encoder built from a raw
    table is recognised from then on); ``.noted``: how many were new."""
    mode = _TablesNoted()
    with mode:
        yield mode
