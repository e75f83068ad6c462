"""What produced a pipeline's embeddings: the fingerprint that namespaces the directory tier.

An entry in a shared directory may only be read by a process that would have encoded the same
bytes. That depends on the pipeline's code (its class and ``encode_prompt`` signature, the
package versions), on the text encoders' weights and buffers (hashed by content: the same
checkpoint on another node matches, a fine-tuned one does not), on the tokenizers (class,
vocabulary, special tokens, limits) and on the kind of device the encoder runs on (a CUDA and a
CPU encode of one prompt differ in their last bits). All of it goes into the description, whose
digest is the namespace.

Hashing the weights reads every encoder byte once per process (and again after new encoder
weights are loaded): about a second per 10 GB on a GPU host. Only the directory tier needs it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import xxhash

_PACKAGES = ("vllm-omni-prompt-cache", "vllm-omni", "vllm", "torch", "transformers", "diffusers")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _attributes(pipeline: Any) -> Iterator[tuple[str, Any]]:
    """Yield the pipeline's own attributes and registered submodules (no properties are run)."""
    yield from vars(pipeline).items()
    yield from (getattr(pipeline, "_modules", None) or {}).items()


def encoder_modules(pipeline: Any) -> dict[str, torch.nn.Module]:
    """Return the pipeline's text encoders by attribute name: ``_encoder_modules`` if it names them,
    else every module attribute whose name starts with ``text_encoder``."""
    named = getattr(pipeline, "_encoder_modules", None)
    found: dict[str, torch.nn.Module] = {}
    for name, value in _attributes(pipeline):
        wanted = name in named if named else name.startswith("text_encoder")
        if wanted and isinstance(value, torch.nn.Module):
            found[name] = value
    return dict(sorted(found.items()))


def weights_digest(module: torch.nn.Module) -> str | None:
    """Return a digest of every parameter and buffer (names, dtypes, shapes, bytes); None if any is not readable."""
    hasher = xxhash.xxh3_128()
    for name, tensor in sorted(module.state_dict(keep_vars=True).items()):
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.layout is not torch.strided:
            return None
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        data = tensor.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        hasher.update(data.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """Return a digest of what makes a tokenizer's ids: class, vocabulary, special tokens, limits, template."""
    hasher = xxhash.xxh3_128(f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}".encode())
    vocabulary = getattr(tokenizer, "get_vocab", None)
    if callable(vocabulary):
        for token, index in sorted(vocabulary().items()):
            hasher.update(f"{token}\0{index}\0".encode("utf-8", "surrogatepass"))
    for name in ("all_special_tokens", "model_max_length", "padding_side", "truncation_side", "chat_template"):
        hasher.update(f"{name}={getattr(tokenizer, name, None)!r}\0".encode("utf-8", "surrogatepass"))
    return hasher.hexdigest()


def pipeline_fingerprint(pipeline: Any, encode_fn: Callable[..., Any], model_tag: str) -> dict[str, Any] | str:
    """Return the JSON-able description of what produces ``pipeline``'s embeddings, or why there is none."""
    encoders = encoder_modules(pipeline)
    if not encoders:
        return f"{type(pipeline).__qualname__} has no text-encoder module to fingerprint"
    weights = {}
    devices = set()
    for name, module in encoders.items():
        digest = weights_digest(module)
        if digest is None:
            return f"the weights of {type(pipeline).__qualname__}.{name} are not readable (offloaded or discarded)"
        weights[name] = digest
        devices.update(tensor.device.type for tensor in module.parameters())
    tokenizers = {}
    for name, value in _attributes(pipeline):
        if name.startswith(("tokenizer", "processor")) and value is not None and not isinstance(value, torch.nn.Module):
            tokenizers[name] = tokenizer_digest(getattr(value, "tokenizer", value))
    try:
        signature = str(inspect.signature(encode_fn))
    except (TypeError, ValueError):
        signature = "unknown"
    return {
        "pipeline": f"{type(pipeline).__module__}.{type(pipeline).__qualname__}",
        "model_tag": model_tag,
        "encode_prompt": signature,
        "encoders": weights,
        "tokenizers": dict(sorted(tokenizers.items())),
        "devices": sorted(devices),
        "versions": {package: _version(package) for package in _PACKAGES},
    }
