"""What produced a pipeline's embeddings: the fingerprint that namespaces the directory tier.

An entry in a shared directory may only be read by a process that would have encoded it the same
way: the same computation, so the same bytes on the same kind of device and kernels (another GPU
model may differ in the last bits, as two encodes on it in different batches may). That depends on
the pipeline's code (the modules of its class and of the classes it derives from, its
``encode_prompt`` signature, the package versions), on its configuration (its public attributes of
plain values: templates, lengths, scale factors), on the text encoders' weights and buffers (hashed
by content: the same checkpoint on another node matches, a fine-tuned one does not), on the
tokenizers and processors (class, vocabulary, special tokens, limits, their config) and on the
kinds of device the encoder and the pipeline run on (a CUDA and a CPU encode of one prompt differ
in their last bits): where the encoder runs, not where its weights wait between calls when an
offload moves them. All of it goes into the description, whose digest is the namespace.

Hashing the weights reads every encoder byte once per process (and again after new encoder
weights are loaded); on a GPU host each tensor is copied to the CPU first. Only the directory tier
needs it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch
import xxhash

from vllm_omni_prompt_cache.encoders.text_encoders import embedding_sources

_PACKAGES = ("vllm-omni-prompt-cache", "vllm-omni", "vllm", "torch", "transformers", "diffusers")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def pipeline_attributes(pipeline: Any) -> Iterator[tuple[str, Any]]:
    """Yield the pipeline's own attributes and registered submodules (no properties are run)."""
    yield from vars(pipeline).items()
    yield from (getattr(pipeline, "_modules", None) or {}).items()


#: Attribute a module that something moves between host and device carries: the device it runs on
#: (set by :mod:`.residency` and :mod:`.vllm_omni.offload`; where its parameters are between calls
#: says nothing of where it encodes).
ENCODE_DEVICE = "_prompt_embed_cache_encode_device"


def encode_devices(module: torch.nn.Module) -> list[torch.device]:
    """Return where ``module`` runs: the device its mover declared, else the devices of its parameters."""
    declared = getattr(module, ENCODE_DEVICE, None)
    if isinstance(declared, torch.device):
        return [declared]
    return list(dict.fromkeys(parameter.device for parameter in module.parameters()))


def weights_digest(module: torch.nn.Module) -> str | None:
    """Return a digest of every parameter and buffer (names, dtypes, shapes, bytes); None if any is not
    readable: meta, or offloaded layer by layer by vLLM-Omni (its blocks then hold empty placeholders)."""
    if any(getattr(each, "_omni_layerwise_enabled", False) for each in module.modules()):
        return None
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


def _plain(value: Any) -> bool:
    """Return True for configuration values: numbers, strings, None, and tuples or lists of them."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    return type(value) in (tuple, list) and len(value) <= 64 and all(_plain(item) for item in value)


def _location(name: str, value: Any) -> bool:
    """Return True for where a model lives (paths differ between nodes and say nothing its weights do not)."""
    return name.endswith(("path", "dir", "directory", "file")) or (isinstance(value, str) and value.startswith("/"))


def configuration(pipeline: Any) -> dict[str, str]:
    """Return the pipeline's public attributes of plain values (set from its config, read by its
    ``encode_prompt``), as reprs. Private ones are left out (pipelines keep per-request state there),
    and so are paths."""
    return {
        name: repr(value)
        for name, value in sorted(vars(pipeline).items())
        if not name.startswith("_") and _plain(value) and not _location(name, value)
    }


def code_digest(kind: type) -> str:
    """Return a digest of the modules that define ``kind`` and the classes it derives from (``object``'s
    aside): their helpers are code ``encode_prompt`` may call."""
    hasher = xxhash.xxh3_128()
    seen: set[str] = set()
    for cls in kind.__mro__:
        if cls.__module__ == "builtins":
            continue
        hasher.update(f"{cls.__module__}.{cls.__qualname__}\0".encode())
        module = inspect.getmodule(cls)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        with contextlib.suppress(OSError, TypeError):  # no source (C, made at run time): its name only
            hasher.update(inspect.getsource(module).encode("utf-8", "surrogatepass"))
    return hasher.hexdigest()


def processor_digest(processor: Any) -> str:
    """Return a digest of a processor: its tokenizer's, and its own configuration when it has one."""
    hasher = xxhash.xxh3_128(tokenizer_digest(getattr(processor, "tokenizer", processor)).encode())
    to_dict = getattr(processor, "to_dict", None)
    if callable(to_dict) and processor is not getattr(processor, "tokenizer", processor):
        # An object the config holds is named by its type: its repr may hold an address.
        config = json.dumps(to_dict(), sort_keys=True, default=lambda value: type(value).__qualname__)
        hasher.update(config.encode("utf-8", "surrogatepass"))
    return hasher.hexdigest()


def code_and_configuration(pipeline: Any, encode_fn: Callable[..., Any] | None, model_tag: str) -> dict[str, Any]:
    """Return the part of the fingerprint that new weights do not change: code, configuration,
    tokenizers, versions, ``encode_prompt``'s signature (``encode_fn``; None when the pipeline has
    none). Which other methods are cached stays out: declaring one must not hide the files of the
    others (each method's keys differ anyway, and the class's code is in). Taken once, at install,
    before any call: public counters a pipeline keeps (calls, rows) are still at their start then,
    in every process."""
    tokenizers = {
        name: processor_digest(value)
        for name, value in pipeline_attributes(pipeline)
        if name.startswith(("tokenizer", "processor")) and value is not None and not isinstance(value, torch.nn.Module)
    }
    try:
        signature = "none" if encode_fn is None else str(inspect.signature(encode_fn))
    except (TypeError, ValueError):
        signature = "unknown"
    return {
        "pipeline": f"{type(pipeline).__module__}.{type(pipeline).__qualname__}",
        "code": code_digest(type(pipeline)),
        "configuration": configuration(pipeline),
        "model_tag": model_tag,
        "encode_prompt": signature,
        "tokenizers": dict(sorted(tokenizers.items())),
        "versions": {package: _version(package) for package in _PACKAGES},
    }


def pipeline_fingerprint(pipeline: Any, fixed: dict[str, Any]) -> dict[str, Any] | str:
    """Return the JSON-able description of what produces ``pipeline``'s embeddings now (``fixed``, from
    :func:`code_and_configuration`, with the encoders' weights and devices), or why there is none."""
    encoders = dict(sorted(embedding_sources(pipeline).items()))
    if not encoders:
        return f"{type(pipeline).__qualname__} has no text-encoder module to fingerprint"
    weights = {}
    devices = set()
    for name, module in encoders.items():
        digest = weights_digest(module)
        if digest is None:
            return f"the weights of {type(pipeline).__qualname__}.{name} are not readable (offloaded or discarded)"
        weights[name] = digest
        devices.update(device.type for device in encode_devices(module))
    pipeline_device = getattr(pipeline, "device", None)
    if isinstance(pipeline_device, torch.device):  # where it encodes, if its encoder is offloaded elsewhere
        devices.add(pipeline_device.type)
    return {**fixed, "encoders": weights, "devices": sorted(devices)}
