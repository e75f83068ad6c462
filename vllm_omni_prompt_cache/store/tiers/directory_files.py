"""The directory tier's file format: what one entry file holds and how it is written, read and checked.

A file is safetensors: the value's tensors and the key's witness bytes, with the namespace, the identity, the
value's structure and a checksum of every tensor byte and of that metadata in its header (see
:mod:`.directory` for where files live and who reads them). A file that fails any check is rejected with a
reason, never raised into the caller.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch
import xxhash

from vllm_omni_prompt_cache.keys.call_key import witness_matches
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.store.tiers.directory_budget import LOW_WATER
from vllm_omni_prompt_cache.store.tiers.directory_trust import (
    KEY_ENV,
    header_of,
    signature_valid,
    writable_by_others,
)

logger = logging.getLogger(__name__)

#: /3: an entry is what one text-encoder call returned, keyed by its inputs (0.3.0); /2 and /1 files held whole
#: encode results (0.2.x) and are refused by this name ("another namespace or format"), never misread.
FORMAT = "vllm-omni-prompt-cache/3"
SUFFIX = ".safetensors"

# Reasons a file is removed on read (the ``reason`` label of the rejection counts).
UNREADABLE = "unreadable or truncated"
CHECKSUM = "checksum mismatch"
FOREIGN = "another namespace or format"
IDENTITY = "key identity differs"
WITNESS = "key bytes differ"
UNSIGNED = "unsigned"
SIGNATURE = "signature mismatch"
NOT_A_FILE = "a link or not a regular file"
TOO_LARGE = "larger than the directory's budget"
DAMAGED_SHARD = "in a damaged shard"
REFUSED_PACKED = "packed, and failed a file's checks"

#: dtypes a file can hold (what safetensors stores).
STORABLE_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)
#: Metadata fields the checksum covers (with every tensor byte).
CHECKED_METADATA = ("format", "namespace", "identity", "structure", "devices", "tensors", "witness")


class Unstorable(Exception):
    """A value a file cannot hold exactly (an object that is not a tensor, plain scalar or container)."""


class Rejected(Exception):
    """A file that must not be used; its message is the reason."""


def identity_name(identity: Hashable) -> str:
    """Return the file name stem of a key identity: a digest of its repr (stable across processes)."""
    return hashlib.sha256(repr(identity).encode("utf-8", "surrogatepass")).hexdigest()[:40]


def value_structure(value: Any, tensors: list[torch.Tensor]) -> Any:
    """Return ``value``'s structure as JSON, appending its tensors to ``tensors``."""
    kind = type(value)
    if isinstance(value, torch.Tensor):
        if value.dtype not in STORABLE_DTYPES or value.layout is not torch.strided or value.is_nested:
            raise Unstorable(f"a {value.dtype} {value.layout} tensor")
        tensors.append(value)
        return {"tensor": len(tensors) - 1}
    if value is None:
        return None
    if kind is bool:
        return {"bool": value}
    if kind is int:
        return {"int": value}
    if kind is float:
        return {"float": value.hex()}
    if kind is str:
        return {"str": value}
    if kind in (tuple, list):
        return {kind.__name__: [value_structure(item, tensors) for item in value]}
    if kind is dict:
        return {
            "dict": [[value_structure(key, tensors), value_structure(item, tensors)] for key, item in value.items()]
        }
    raise Unstorable(f"a {kind.__module__}.{kind.__qualname__}")


def rebuilt_value(structure: Any, tensors: list[torch.Tensor]) -> Any:
    if structure is None:
        return None
    (kind, content), *_ = structure.items()
    if kind == "tensor":
        return tensors[content]
    if kind in ("bool", "int", "str"):
        return content
    if kind == "float":
        return float.fromhex(content)
    if kind == "tuple":
        return tuple(rebuilt_value(item, tensors) for item in content)
    if kind == "list":
        return [rebuilt_value(item, tensors) for item in content]
    if kind == "dict":
        return {rebuilt_value(key, tensors): rebuilt_value(item, tensors) for key, item in content}
    raise ValueError(f"unknown structure kind {kind!r}")


def checksum_of(tensors: list[torch.Tensor], metadata: dict[str, str]) -> str:
    hasher = xxhash.xxh3_128()
    for name in CHECKED_METADATA:
        hasher.update(f"{name}={metadata[name]}\0".encode("utf-8", "surrogatepass"))
    for tensor in tensors:
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def read_metadata(data: bytes) -> dict[str, str]:
    return header_of(data)[1]["__metadata__"]


def witness_tensor(part: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(part), dtype=torch.uint8) if part else torch.empty(0, dtype=torch.uint8)


def encode_entry(namespace: str, identity: Hashable, witness: tuple[bytes, ...], value: Any) -> bytes:
    """Return the safetensors bytes of an entry's file (unsigned); raise Unstorable for a value no file holds."""
    from safetensors.torch import save

    originals: list[torch.Tensor] = []
    structure = value_structure(value, originals)
    # Owned copies: safetensors refuses tensors that share memory (views of one output).
    values = [tensor.detach().to("cpu", copy=True).contiguous() for tensor in originals]
    kept = [witness_tensor(part) for part in witness]
    tensors = {f"value.{index}": tensor for index, tensor in enumerate(values)}
    tensors.update({f"witness.{index}": part for index, part in enumerate(kept)})
    metadata = {
        "format": FORMAT,
        "namespace": namespace,
        "identity": repr(identity),
        "structure": json.dumps(structure),
        "devices": json.dumps([str(tensor.device) for tensor in originals]),
        "tensors": str(len(values)),
        "witness": str(len(kept)),
    }
    metadata["checksum"] = checksum_of(values + kept, metadata)
    return save(tensors, metadata)


def read_entry_file(path: Path, max_bytes: int | None, key: bytes | None) -> bytes:
    """Return the bytes of the file at ``path``: never through a link, never from a device or pipe, never
    one larger than a write within ``max_bytes`` could be (raise Rejected); raise OSError when there is
    none. Unsigned (no ``key``), a file others can write to is said once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ELOOP:  # a link where an entry's file should be
            raise Rejected(NOT_A_FILE) from None
        raise
    with os.fdopen(fd, "rb") as file:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise Rejected(NOT_A_FILE)
        if max_bytes is not None and status.st_size > LOW_WATER * max_bytes:
            raise Rejected(TOO_LARGE)  # never written here: not worth reading into memory
        if key is None and (how := writable_by_others(path, status=status)) is not None:
            warn_untrusted(how)
        return file.read()


def decode_entry(
    data: bytes, namespace: str, identity: Hashable, witness: tuple, key: bytes | None
) -> tuple[list[torch.Tensor], dict[str, str]]:
    """Return a file's value tensors (on the CPU) and metadata, every check passed (its signature under
    ``key`` first, when there is one); raise Rejected."""
    from safetensors.torch import load

    if key is not None:  # before anything else reads the file
        try:
            signed = signature_valid(data, key)
        except Exception:
            raise Rejected(UNREADABLE) from None
        if not signed:
            raise Rejected(UNSIGNED if signed is None else SIGNATURE)
    try:
        metadata = read_metadata(data)
        tensors = load(data)
    except Exception:
        raise Rejected(UNREADABLE) from None
    if metadata.get("format") != FORMAT or metadata.get("namespace") != namespace:
        raise Rejected(FOREIGN)
    if metadata.get("identity") != repr(identity):
        raise Rejected(IDENTITY)
    values = [tensors[f"value.{index}"] for index in range(int(metadata["tensors"]))]
    kept = [tensors[f"witness.{index}"] for index in range(int(metadata["witness"]))]
    if checksum_of(values + kept, metadata) != metadata.get("checksum"):
        raise Rejected(CHECKSUM)
    if not witness_matches(tuple(part.numpy().tobytes() for part in kept), witness):
        raise Rejected(WITNESS)
    return values, metadata


def warn_untrusted(how: str) -> None:
    """Say once that an unsigned directory others can write to serves whatever they write."""
    warn_once(
        f"the directory tier is not signed and others can write to it ({how}): whoever can write there "
        f"can change the embeddings this process serves; set a signing key ({KEY_ENV} or "
        "prompt_embed_cache_dir_key_file) or keep the directory to this user"
    )
