"""Who may change what the directory tier serves: signed files, file modes, links, and the settings.

Each "process" is its own tiny real Qwen2 encoder behind a token-ID ``encode_prompt`` and its own
cache on one directory (see test_tiers.py). The planter is anyone who can write to the directory:
it knows the prompts, so it writes the right key bytes, and it runs this package's own writer, so
its checksum is right too; only a key it does not hold tells its file apart.
"""

from __future__ import annotations

import argparse
import grp
import json
import logging
import os
import stat
import time
from pathlib import Path

import pytest
import torch
from test_tiers import _key_and_entry_of, _key_of, _write, encode, files, process, reference, same

from vllm_omni_prompt_cache.keys.call_key import CallKey, freeze_witness
from vllm_omni_prompt_cache.settings.resolved import resolve_prompt_embed_cache_settings
from vllm_omni_prompt_cache.settings.schema import (
    DIRECTORY,
    DIRECTORY_GROUP,
    DIRECTORY_KEY_FILE,
    PromptEmbedCacheConfigError,
)
from vllm_omni_prompt_cache.store.tiers.directory_files import (
    NOT_A_FILE,
    SIGNATURE,
    SUFFIX,
    TOO_LARGE,
    UNSIGNED,
    identity_name,
)
from vllm_omni_prompt_cache.store.tiers.directory_trust import KEY_ENV, sign, signature_valid
from vllm_omni_prompt_cache.vllm_omni.cli_args import add_prompt_cache_arguments

KEY = b"7f3a1c9e5b2d4f6a8c0e1b3d5f7a9c2e"


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    for setting in (DIRECTORY, DIRECTORY_KEY_FILE, DIRECTORY_GROUP):
        monkeypatch.delenv(setting.env, raising=False)


def plant(root: Path, index: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a wrong entry (the text encoder's output, zeros) under the name of prompt ``index``'s encoder call,
    key bytes and checksum right; return what an encode served from it returns (zero embeddings, the real mask)."""
    planter, cache = process(root, **kwargs)
    (identity, witness), entry = _key_and_entry_of(planter, index)
    tag, form, leaves = entry
    wrong = (tag, form, tuple(None if leaf is None else torch.zeros_like(leaf) for leaf in leaves))
    _write(cache.directory, identity, freeze_witness(witness), wrong)
    embeds, mask = reference(index)
    return torch.zeros_like(embeds), mask


def test_a_planted_embedding_is_served_without_a_key_and_refused_with_one(tmp_path) -> None:
    wrong = plant(tmp_path, 0)
    unkeyed, _ = process(tmp_path)
    assert same(encode(unkeyed, 0), wrong) and unkeyed.encoder_runs == 0  # the hole a key closes
    keyed, cache = process(tmp_path, directory_key=KEY)
    assert same(encode(keyed, 0), reference(0)) and keyed.encoder_runs == 1
    assert cache.snapshot().dir_rejections == {UNSIGNED: 1}
    (path,) = files(tmp_path)
    assert signature_valid(path.read_bytes(), KEY)  # what the keyed process wrote in its place
    again, cache = process(tmp_path, directory_key=KEY)
    assert same(encode(again, 0), reference(0)) and again.encoder_runs == 0 and cache.snapshot().dir_hits == 1
    wrong = plant(tmp_path, 0, directory_key=b"a key the readers do not hold")
    victim, cache = process(tmp_path, directory_key=KEY)
    assert same(encode(victim, 0), reference(0)) and victim.encoder_runs == 1
    assert cache.snapshot().dir_rejections == {SIGNATURE: 1}


def test_the_signature_covers_every_byte_and_every_header_field(tmp_path) -> None:
    writer, _ = process(tmp_path, directory_key=KEY)
    encode(writer, 0)
    (path,) = files(tmp_path)
    signed = path.read_bytes()
    assert signature_valid(signed, KEY) is True and signature_valid(signed, KEY[::-1]) is False
    length = int.from_bytes(signed[:8], "little")
    for offset in (8 + length, len(signed) // 2 + length // 2, len(signed) - 1):  # data bytes
        damaged = bytearray(signed)
        damaged[offset] ^= 0x01
        assert signature_valid(bytes(damaged), KEY) is False
    header = signed[8 : 8 + length].decode()
    renamed = header.replace('"identity":"', '"identity":"X', 1)  # a metadata field, same length otherwise
    assert renamed != header
    assert signature_valid(len(renamed).to_bytes(8, "little") + renamed.encode() + signed[8 + length :], KEY) is False
    assert signature_valid(sign(signed, KEY), KEY)  # signing again replaces the signature


def test_a_link_planted_where_an_entry_would_be_is_never_followed(tmp_path) -> None:
    writer, _ = process(tmp_path / "elsewhere")
    encode(writer, 0)
    (outside,) = files(tmp_path / "elsewhere")  # a valid file of the same model, outside the directory
    root = tmp_path / "shared"
    probe, cache = process(root)
    encode(probe, 5)  # makes the namespace directory
    link = cache.directory.root / cache.directory.namespace / outside.name
    link.symlink_to(outside)
    reader, cache = process(root)
    assert same(encode(reader, 0), reference(0)) and reader.encoder_runs == 1
    assert cache.snapshot().dir_rejections == {NOT_A_FILE: 1}
    assert not link.is_symlink() and link.is_file()  # the link removed; the encode wrote a real file
    assert outside.is_file()  # the target untouched
    fifo = link.with_name(identity_name("a pipe") + SUFFIX)  # a plain open() of a pipe blocks
    os.mkfifo(fifo)
    assert cache.directory.get(CallKey("a pipe", ()), claim=False) == (False, None)
    assert cache.snapshot().dir_rejections == {NOT_A_FILE: 2} and not fifo.exists()


def test_files_and_directories_are_not_writable_by_group_or_others(tmp_path) -> None:
    old = os.umask(0o002)  # a umask that would let the group write
    try:
        writer, cache = process(tmp_path / "root")
        encode(writer, 0)
        cache.directory.get(_key_of(writer, 1))  # leaves a claim file
    finally:
        os.umask(old)
    namespace = cache.directory.root / cache.directory.namespace
    made = [namespace, *namespace.iterdir()]
    assert {path.suffix for path in made} == {"", ".json", ".safetensors", ".claim"}
    for path in made:
        assert not path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH), (path, stat.filemode(path.stat().st_mode))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another group needs root or membership")
def test_a_shared_group_gets_group_write_and_ownership(tmp_path) -> None:
    group = next(entry for entry in grp.getgrall() if entry.gr_gid != os.getegid())
    settings = resolve_prompt_embed_cache_settings(directory=tmp_path / "root", directory_group=group.gr_name)
    assert settings.directory_group == group.gr_gid
    writer, cache = process(tmp_path / "root", directory_group=settings.directory_group)
    encode(writer, 0)
    namespace = cache.directory.root / cache.directory.namespace
    assert stat.S_IMODE(namespace.stat().st_mode) == 0o2770 and namespace.stat().st_gid == group.gr_gid
    for path in namespace.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o660 and path.stat().st_gid == group.gr_gid


def test_an_unsigned_directory_others_can_write_to_is_said_once(tmp_path) -> None:
    from vllm_omni_prompt_cache import logs

    said: list[str] = []
    listener = logging.Handler(logging.WARNING)
    listener.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    ours = logging.getLogger("vllm_omni_prompt_cache")
    ours.addHandler(listener)  # on our logger itself: after an engine ran here it may not propagate
    level, ours.disabled = ours.level, False
    ours.setLevel(logging.WARNING)  # whatever level an earlier test's plugin load left it at
    logs._said.clear()
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    try:
        for key in (KEY, KEY, None, None):
            reader, _ = process(root, directory_key=key)
            encode(reader, 0)
            if key is not None:
                assert not [message for message in said if "not signed" in message]
    finally:
        ours.removeHandler(listener)
        ours.setLevel(level)
    warned = [message for message in said if "not signed" in message]
    assert len(warned) == 1 and f"{root} is writable by everyone" in warned[0] and KEY_ENV in warned[0]


def test_the_key_settings_are_checked_and_the_key_never_travels_in_the_settings(tmp_path, monkeypatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    key_file.chmod(0o600)
    settings = resolve_prompt_embed_cache_settings(
        enable=True, directory=tmp_path / "dir", directory_key_file=str(key_file)
    )
    assert settings.directory_key_file == str(key_file)
    assert KEY.decode() not in repr(settings) and KEY.decode() not in repr(settings.as_dict())
    key_file.chmod(0o644)
    with pytest.raises(PromptEmbedCacheConfigError, match=r"prompt_embed_cache_dir_key_file=.*-rw-r--r--.*chmod 600"):
        resolve_prompt_embed_cache_settings(enable=True, directory=tmp_path / "dir", directory_key_file=str(key_file))
    key_file.chmod(0o600)
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    with pytest.raises(PromptEmbedCacheConfigError, match=f"two signing keys: environment variable {KEY_ENV}"):
        resolve_prompt_embed_cache_settings(enable=True, directory=tmp_path / "dir", directory_key_file=str(key_file))
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(PromptEmbedCacheConfigError, match=f"invalid environment variable {KEY_ENV}: .* 5 bytes"):
        resolve_prompt_embed_cache_settings(enable=True, directory=tmp_path / "dir")
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    with pytest.raises(PromptEmbedCacheConfigError, match=f"{KEY_ENV} set, but prompt_embed_cache_dir is not"):
        resolve_prompt_embed_cache_settings(enable=True)
    assert not resolve_prompt_embed_cache_settings().enabled  # a key exported everywhere: cache-less engines start
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(PromptEmbedCacheConfigError, match=r"invalid prompt_embed_cache_dir_key_file='/no/such'"):
        resolve_prompt_embed_cache_settings(enable=True, directory=tmp_path / "dir", directory_key_file="/no/such")
    monkeypatch.setenv(DIRECTORY_GROUP.env, "no-such-group")
    with pytest.raises(PromptEmbedCacheConfigError, match=f"from environment variable {DIRECTORY_GROUP.env}: expected"):
        resolve_prompt_embed_cache_settings(enable=True, directory=tmp_path / "dir")


def test_the_serve_command_takes_a_key_file_flag_and_no_key_flag() -> None:
    """The key's value never appears on a command line (``ps`` shows those): a file path only."""
    parser = argparse.ArgumentParser()
    add_prompt_cache_arguments(parser)
    flags = set(parser._option_string_actions)
    assert {"--prompt-embed-cache-dir-key-file", "--prompt-embed-cache-dir-group"} <= flags
    assert not [flag for flag in flags if flag.endswith("-key")]


def test_the_stage_install_signs_with_the_key_file_and_shares_with_the_group(tmp_path) -> None:
    """What a diffusion worker does with the settings it was sent: the key is read from the file there."""
    from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder
    from vllm_omni_prompt_cache.vllm_omni import runner

    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    group = os.getegid()
    sent = resolve_prompt_embed_cache_settings(
        enable=True, directory=tmp_path / "root", directory_key_file=str(key_file), directory_group=str(group)
    ).as_dict()
    settings = type(resolve_prompt_embed_cache_settings()).from_dict(sent, "the stage config")
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = runner.install_for_stage(pipeline, settings, "tiny")
    encode(pipeline, 0)
    (path,) = files(tmp_path / "root")
    assert signature_valid(path.read_bytes(), KEY) and path.stat().st_gid == group
    assert stat.S_IMODE(path.stat().st_mode) == 0o660 and cache.directory.modes.group == group


def test_a_worker_without_the_engines_key_refuses_to_start(tmp_path, monkeypatch) -> None:
    """The env-var key does not travel in the settings; its id does, so a worker missing it says so."""
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    sent = resolve_prompt_embed_cache_settings(enable=True, directory=tmp_path).as_dict()
    assert KEY.decode() not in repr(sent)
    settings_type = type(resolve_prompt_embed_cache_settings())
    assert settings_type.from_dict(sent, "the stage config").directory_key_id == sent["directory_key_id"]
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(PromptEmbedCacheConfigError, match=r"signing key id [0-9a-f]{16}, but this process has none"):
        settings_type.from_dict(sent, "the stage config")
    monkeypatch.setenv(KEY_ENV, "another key of sixteen bytes or more")
    with pytest.raises(PromptEmbedCacheConfigError, match="this process has another"):
        settings_type.from_dict(sent, "the stage config")


def test_a_pipe_or_link_planted_while_a_process_waits_for_a_claim_is_never_opened(tmp_path) -> None:
    """The wait reads the entry's file again and again: each read must be as careful as the first.

    The pipe is planted through the tier's public claims: each time the waiter tries the entry's
    claim, so after its first read found nothing (as a racing writer would) and before each read
    of the wait.
    """
    holder, holder_cache = process(tmp_path)
    key = _key_of(holder, 0)
    identity = key.identity
    assert holder_cache.directory.get(key) == (False, None)  # claims prompt 0, encodes "later"
    waiter, cache = process(tmp_path, directory_key=None)
    tier = cache.directory
    tier.claims.wait_s = 1.0
    path = tier.root / tier.namespace / (identity_name(identity) + SUFFIX)
    try_claim = tier.claims.try_claim

    def plant_then_claim(claim_key, entry):
        if not path.exists() and not path.is_symlink():
            os.mkfifo(path)
        return try_claim(claim_key, entry)

    tier.claims.try_claim = plant_then_claim
    began = time.monotonic()
    assert same(encode(waiter, 0), reference(0))  # a plain open() of the pipe would block here for good
    assert time.monotonic() - began < 5 and cache.snapshot().dir_rejections[NOT_A_FILE] >= 1


def test_a_file_larger_than_the_budget_is_refused_before_it_is_read(tmp_path) -> None:
    writer, cache = process(tmp_path)
    encode(writer, 0)
    (path,) = files(tmp_path)
    with open(path, "r+b") as file:
        file.truncate(64 * 2**20)  # sparse: what a hostile writer makes to exhaust readers' memory
    reader, cache = process(tmp_path, directory_bytes=2**20)
    assert same(encode(reader, 0), reference(0)) and reader.encoder_runs == 1
    assert cache.snapshot().dir_rejections == {TOO_LARGE: 1}


def test_a_signature_that_is_not_ascii_is_a_mismatch(tmp_path) -> None:
    writer, _ = process(tmp_path, directory_key=KEY)
    encode(writer, 0)
    (path,) = files(tmp_path)
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"]["signature"] = "é" * 64
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    assert signature_valid(len(text).to_bytes(8, "little") + text + data[8 + length :], KEY) is False
