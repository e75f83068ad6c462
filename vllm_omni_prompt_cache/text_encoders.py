"""Which of a pipeline's child modules are its text encoders: one answer for the watch, the fingerprint and offload.

A text encoder turns integer token ids into hidden states, so its input layer is a token embedding:
the layer Hugging Face's ``get_input_embeddings()`` names where the module has one (a vision-language
encoder's vision tower comes first in its module order, its token embedding is still its input), else
its first layer holding weights (torch modules register their layers in the order they run). Holding
an embedding somewhere is not enough: a DiT may keep a small one for a condition (Qwen-Image's
additional-t embedding, HunyuanVideo 1.5's condition type), and an image encoder one for positions
(CLIP's and SigLIP's vision towers, whose input layer is a patch convolution). Attribute names play no
part: a text encoder under ``prompt_tower`` is one, a connector listed with the encoders is not.

:mod:`.discovery` watches the token embeddings of these modules, :mod:`.residency` and
:mod:`.vllm_omni.offload` move and count them. What the directory fingerprint hashes and what a weight load
empties the cache for are these and the encoders the pipeline declares itself (:func:`embedding_sources`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def child_modules(pipeline: Any) -> dict[str, torch.nn.Module]:
    """Return the pipeline's direct child modules by attribute name (a torch module's children, else its attributes)."""
    if isinstance(pipeline, torch.nn.Module):
        return dict(pipeline.named_children())
    try:
        attributes = vars(pipeline)
    except TypeError:
        return {}
    return {name: value for name, value in attributes.items() if isinstance(value, torch.nn.Module)}


def is_token_embedding(module: torch.nn.Module) -> bool:
    """Return True for a table of vectors looked up by integer id: an ``nn.Embedding``, or a vocabulary-parallel
    one (vLLM's ``VocabParallelEmbedding`` and its kin: ``num_embeddings``, ``embedding_dim`` and a 2-D weight)."""
    if isinstance(module, torch.nn.Embedding):
        return True
    weight = module._parameters.get("weight")
    embedding_dim = getattr(module, "embedding_dim", None)
    return (
        isinstance(getattr(module, "num_embeddings", None), int)
        and isinstance(embedding_dim, int)
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[1] == embedding_dim
    )


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
    """Return True when ``module``'s input layer is a token embedding (see the module docstring)."""
    layer = input_layer(module)
    return layer is not None and is_token_embedding(layer)


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
