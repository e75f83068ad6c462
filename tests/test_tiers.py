"""Tiers below device memory: the host-memory LRU and the shared directory of safetensors files.

A tiny real transformers encoder (random weights) behind a token-ID ``encode_prompt``; each
"process" of the directory tests is its own pipeline and cache on one directory, as replicas and
restarted engines are. Faults are made for real: files truncated, corrupted and copied between
namespaces on disk, a full disk (a 64 KiB tmpfs when this machine lets us mount one; otherwise a
simulated ENOSPC, said so), concurrent writers.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_omni_prompt_cache import PromptEmbedCache, install_prompt_embed_cache
from vllm_omni_prompt_cache.counts.counters import DIR_REJECTIONS, HOST_DEMOTIONS
from vllm_omni_prompt_cache.keys.call_key import CallKey, CallKeyBuilder
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.store.entries import Entry
from vllm_omni_prompt_cache.store.flights import Ticket
from vllm_omni_prompt_cache.store.tiers.directory import DirectoryTier
from vllm_omni_prompt_cache.store.tiers.directory_files import CHECKSUM, FOREIGN, UNREADABLE, WITNESS
from vllm_omni_prompt_cache.store.tiers.tier import Stamp
from vllm_omni_prompt_cache.tiny.text_encoder import QwenStyleTokenPipeline, TokenIdTextPipeline, build_qwen2_encoder
from vllm_omni_prompt_cache.vllm_omni.lifecycle import release_device_memory

PROMPTS = [torch.tensor([[3, 1, 4, 1, 5, i]]) for i in range(6)]


def encode(pipeline: TokenIdTextPipeline, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = PROMPTS[index]
    return pipeline.encode_prompt(ids.clone(), torch.ones_like(ids))


def reference(index: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return encode(TokenIdTextPipeline(build_qwen2_encoder(seed=seed)), index)


def same(left: tuple, right: tuple) -> bool:
    return all(
        a.dtype == b.dtype and a.device == b.device and torch.equal(a, b) for a, b in zip(left, right, strict=True)
    )


def files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.safetensors"))


# --- host tier ---------------------------------------------------------------------------------


def test_an_entry_evicted_from_device_memory_is_served_from_host_memory() -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, max_size=2, settings=PromptEmbedCacheSettings(host_bytes=2**20))
    outputs = [encode(pipeline, index) for index in range(3)]  # the first is evicted to host memory
    stats = cache.snapshot()
    assert (stats.size, stats.evictions, stats.host_entries, stats.host_demotions) == (2, 1, 1, 1)
    assert same(encode(pipeline, 0), outputs[0])  # from host memory: no encode
    stats = cache.snapshot()
    assert pipeline.encoder_runs == 3
    assert (stats.host_hits, stats.hits, stats.misses) == (1, 1, 3)
    assert stats.host_entries == 1  # prompt 1 went down when prompt 0 came back up


def test_sleep_moves_every_entry_to_host_memory_and_a_clear_empties_every_tier() -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, max_size=8, settings=PromptEmbedCacheSettings(host_bytes=2**20))
    outputs = [encode(pipeline, index) for index in range(3)]
    release_device_memory(pipeline, "a test sleeps")
    assert (len(cache), len(cache.host), cache.snapshot().bytes) == (0, 3, 0)
    assert all(same(encode(pipeline, index), outputs[index]) for index in range(3))
    assert pipeline.encoder_runs == 3
    cache.clear()  # new weights: nothing of any tier may be served
    assert (len(cache), len(cache.host)) == (0, 0)
    encode(pipeline, 0)
    assert pipeline.encoder_runs == 4


def test_the_host_budget_evicts_the_oldest_and_refuses_what_cannot_fit() -> None:
    measured = install_prompt_embed_cache(probe := TokenIdTextPipeline(build_qwen2_encoder()), max_size=1)
    encode(probe, 0)
    entry_bytes = measured.snapshot().bytes  # every prompt here has the same shapes
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(
        pipeline, max_size=1, settings=PromptEmbedCacheSettings(host_bytes=2 * entry_bytes)
    )
    for index in range(4):  # prompts 0, 1, 2 leave device memory in turn; the host holds two
        encode(pipeline, index)
    stats = cache.snapshot()
    assert (stats.host_entries, stats.host_demotions, stats.host_evictions) == (2, 3, 1)
    assert stats.host_bytes == 2 * entry_bytes
    encode(pipeline, 0)  # evicted from the host too: encoded again
    encode(pipeline, 2)  # still in host memory
    assert pipeline.encoder_runs == 5 and cache.snapshot().host_hits == 1

    tight = install_prompt_embed_cache(
        small := TokenIdTextPipeline(build_qwen2_encoder()),
        max_size=1,
        settings=PromptEmbedCacheSettings(host_bytes=1),
    )
    encode(small, 1)
    encode(small, 2)  # prompt 1 leaves device memory, larger than the whole host budget
    stats = tight.snapshot()
    assert (stats.host_entries, stats.host_demotions, stats.host_evictions) == (0, 0, 1)


def test_by_default_a_sleeps_entries_wait_in_host_memory_and_evictions_do_not() -> None:
    """The default host tier keeps what a level-1 sleep drops (the same weights come back on wake), within the
    device tier's own limits; an entry the device tier's budget evicts is gone, as without a host tier."""
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, max_size=2)
    outputs = [encode(pipeline, index) for index in range(3)]  # prompt 0 is evicted: not kept
    stats = cache.snapshot()
    assert (stats.evictions, stats.host_entries, stats.host_keeps, stats.host_max_entries) == (
        1,
        0,
        "sleep_departures",
        2,
    )
    release_device_memory(pipeline, "a test sleeps")
    assert (len(cache), len(cache.host)) == (0, 2)
    assert same(encode(pipeline, 1), outputs[1]) and same(encode(pipeline, 2), outputs[2])
    assert pipeline.encoder_runs == 3  # both came back from host memory
    assert same(encode(pipeline, 0), outputs[0]) and pipeline.encoder_runs == 4  # the evicted one is encoded

    off = install_prompt_embed_cache(
        other := TokenIdTextPipeline(build_qwen2_encoder()),
        max_size=2,
        settings=PromptEmbedCacheSettings(host_bytes=None),
    )
    encode(other, 0)
    release_device_memory(other, "a test sleeps")
    assert off.host is None and len(off) == 0
    encode(other, 0)
    assert other.encoder_runs == 2  # 'off': a sleep clears the cache, as before


def test_a_sleeps_host_entries_stay_within_the_device_tiers_byte_budget() -> None:
    measured = install_prompt_embed_cache(probe := TokenIdTextPipeline(build_qwen2_encoder()), max_size=1)
    encode(probe, 0)
    entry_bytes = measured.snapshot().bytes
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(
        pipeline, max_size=8, settings=PromptEmbedCacheSettings(max_bytes=3 * entry_bytes)
    )
    for index in range(3):
        encode(pipeline, index)
    release_device_memory(pipeline, "a test sleeps")
    for index in range(3, 6):  # after the wake, three new prompts fill device memory again
        encode(pipeline, index)
    release_device_memory(pipeline, "a test sleeps again")
    stats = cache.snapshot()
    assert stats.host_bytes <= 3 * entry_bytes and stats.host_entries == 3  # the newest three; the oldest went
    assert (stats.host_demotions, stats.host_evictions) == (6, 3)


# --- directory tier ----------------------------------------------------------------------------


def process(root: Path, *, seed: int = 0, **kwargs) -> tuple[TokenIdTextPipeline, PromptEmbedCache]:
    """A new "process": its own pipeline (weights from ``seed``) and cache on ``root``."""
    pipeline = TokenIdTextPipeline(build_qwen2_encoder(seed=seed))
    cache = install_prompt_embed_cache(
        pipeline, max_size=8, settings=PromptEmbedCacheSettings(directory=root, **kwargs)
    )
    return pipeline, cache


def test_a_second_process_on_the_directory_encodes_nothing_and_gets_identical_bytes(tmp_path) -> None:
    writer, _ = process(tmp_path)
    written = [encode(writer, index) for index in range(3)]
    assert len(files(tmp_path)) == 3
    namespace = files(tmp_path)[0].parent
    assert (namespace / "NAMESPACE.json").is_file()  # what produced the files, for people
    reader, cache = process(tmp_path)
    read = [encode(reader, index) for index in range(3)]
    assert reader.encoder_runs == 0
    assert all(same(a, b) for a, b in zip(read, written, strict=True))
    stats = cache.snapshot()
    assert (stats.dir_hits, stats.hits, stats.misses, stats.dir_writes) == (3, 3, 0, 0)
    assert encode(reader, 0) is not None and cache.snapshot().dir_hits == 3  # now a device hit


def test_other_weights_never_read_the_files(tmp_path) -> None:
    writer, _ = process(tmp_path, seed=0)
    encode(writer, 0)
    other, cache = process(tmp_path, seed=1)  # another checkpoint of the same architecture
    assert same(encode(other, 0), reference(0, seed=1))
    assert other.encoder_runs == 1
    assert cache.snapshot().dir_hits == 0
    assert len({path.parent for path in files(tmp_path)}) == 2  # two namespaces


def test_new_encoder_weights_move_the_process_to_another_namespace(tmp_path) -> None:
    pipeline, cache = process(tmp_path)
    encode(pipeline, 0)
    with torch.no_grad():
        pipeline.text_encoder.embed_tokens.weight.mul_(2.0)  # as a weight sync would
    cache.clear()  # what the lifecycle hook does after an encoder weight load
    twin = build_qwen2_encoder()  # the loaded weights in an encoder of its own: the pipeline's calls are served
    twin.load_state_dict(pipeline.text_encoder.state_dict())
    assert same(encode(pipeline, 0), encode(TokenIdTextPipeline(twin), 0))
    assert pipeline.encoder_runs == 2 and cache.snapshot().dir_hits == 0


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncate", UNREADABLE),
        ("flip a value byte", CHECKSUM),
        ("empty", UNREADABLE),
    ],
)
def test_a_damaged_file_is_a_miss_removed_and_counted(tmp_path, damage, reason) -> None:
    writer, _ = process(tmp_path)
    expected = encode(writer, 0)
    (path,) = files(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":  # a writer killed mid-write without the rename would leave no file; a disk can
        data = data[: len(data) // 2]
    elif damage == "flip a value byte":
        data[-5] ^= 0x40
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    reader, cache = process(tmp_path)
    assert same(encode(reader, 0), expected)  # encoded again, exactly
    stats = cache.snapshot()
    assert (reader.encoder_runs, stats.dir_hits, stats.dir_misses) == (1, 0, 1)
    assert stats.dir_rejections == {reason: 1}
    assert len(files(tmp_path)) == 1  # removed, then written again by the encode: it serves the next process
    third, _ = process(tmp_path)
    assert same(encode(third, 0), expected) and third.encoder_runs == 0


def test_a_file_from_another_model_under_this_models_name_is_refused(tmp_path) -> None:
    writer, _ = process(tmp_path, seed=0)
    encode(writer, 0)
    other, _ = process(tmp_path, seed=1)
    encode(other, 0)
    seed_1_file = next(
        path
        for path in files(tmp_path)
        if path.parent == other._prompt_embed_cache.directory.root / other._prompt_embed_cache.directory.namespace
    )
    seed_0_file = next(path for path in files(tmp_path) if path != seed_1_file)
    shutil.copyfile(seed_0_file, seed_1_file)  # the same key's name, holding the other model's file
    reader, cache = process(tmp_path, seed=1)
    assert same(encode(reader, 0), reference(0, seed=1))
    stats = cache.snapshot()
    assert (reader.encoder_runs, stats.dir_hits, stats.dir_rejections) == (1, 0, {FOREIGN: 1})


def test_a_file_whose_witness_differs_is_never_served(tmp_path) -> None:
    """A digest that collides on every input: one key identity for all prompts, told apart only
    by the witness bytes kept in the file."""
    encoder = build_qwen2_encoder()
    writer = TokenIdTextPipeline(encoder)
    install_prompt_embed_cache(
        writer, settings=PromptEmbedCacheSettings(directory=tmp_path, digest=lambda data: b"same")
    )
    encode(writer, 0)
    reader = TokenIdTextPipeline(encoder)
    cache = install_prompt_embed_cache(
        reader, settings=PromptEmbedCacheSettings(directory=tmp_path, digest=lambda data: b"same")
    )
    assert same(encode(reader, 1), reference(1))  # prompt 1 finds prompt 0's file under its name
    stats = cache.snapshot()
    assert (reader.encoder_runs, stats.dir_hits, stats.dir_rejections) == (1, 0, {WITNESS: 1})


def mounted_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return result.returncode == 0


def test_a_full_disk_is_counted_and_the_cache_keeps_serving(tmp_path, monkeypatch) -> None:
    disk = tmp_path / "disk"
    real = mounted_tmpfs(disk, "64k")  # a real full filesystem where this machine lets us (root, mount)
    try:
        if not real:  # simulated: the write raises what a full disk raises
            monkeypatch.setattr(
                DirectoryTier,
                "_write_atomically",
                staticmethod(lambda path, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left"))),
            )
        pipeline = TokenIdTextPipeline(build_qwen2_encoder(hidden_size=256, intermediate_size=256))
        cache = install_prompt_embed_cache(
            pipeline, max_size=8, settings=PromptEmbedCacheSettings(directory=disk, directory_bytes=None)
        )
        long_ids = torch.arange(200).reshape(1, -1)
        for shift in range(4):  # 200 x 256 fp32: 200 KiB an entry, more than the disk holds
            pipeline.encode_prompt(long_ids + shift, torch.ones_like(long_ids))
        stats = cache.snapshot()
        assert stats.dir_write_errors >= 3 and stats.size == 4
        assert pipeline.encode_prompt(long_ids, torch.ones_like(long_ids)) is not None
        assert pipeline.encoder_runs == 4  # served from memory
        if real:  # (the simulated write makes no temporary file)
            assert not list(disk.glob("*/.*.tmp"))  # no temporary file left behind
    finally:
        if real:
            subprocess.run(["umount", str(disk)], check=False)


def test_concurrent_writers_and_readers_of_one_key_never_see_a_partial_file(tmp_path) -> None:
    encoder = build_qwen2_encoder()
    first = TokenIdTextPipeline(encoder)
    first_cache = install_prompt_embed_cache(first, settings=PromptEmbedCacheSettings(directory=tmp_path))
    encode(first, 0)  # a file exists; now four writers rewrite it and read it back, all at once
    key = _key_of(first, 0)
    found, expected = first_cache.lookups.get(key, "encode_prompt")  # the entry: what the text encoder returned
    assert found and len(files(tmp_path)) == 1
    tiers = [
        install_prompt_embed_cache(
            TokenIdTextPipeline(encoder), settings=PromptEmbedCacheSettings(directory=tmp_path)
        ).directory
        for _ in range(4)
    ]
    witness = tuple(part.tobytes() for part in key.witness)
    failures: list[str] = []

    def hammer(tier: DirectoryTier) -> None:
        for _ in range(40):
            _write(tier, key.identity, witness, expected)
            found, value = tier.get(key)
            if not found or not same_entry(value, expected):
                failures.append("a writer's own read missed or differed")

    threads = [threading.Thread(target=hammer, args=(tier,)) for tier in tiers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert all(sum(tier.counts()[DIR_REJECTIONS].values()) == 0 for tier in tiers)
    assert len(files(tmp_path)) == 1 and not list(tmp_path.glob("*/.*.tmp"))


def test_the_directory_budget_removes_the_least_recently_used_files(tmp_path) -> None:
    writer, cache = process(tmp_path)
    encode(writer, 0)
    entry_bytes = files(tmp_path)[0].stat().st_size
    writer, cache = process(tmp_path, directory_bytes=3 * entry_bytes + entry_bytes // 2)
    for index in (1, 2):
        encode(writer, index)
    reader, _ = process(tmp_path)
    encode(reader, 0)  # a hit refreshes prompt 0's file: prompt 1's is now the oldest
    for index in (3, 4):
        encode(writer, index)
    stats = cache.snapshot()
    assert stats.dir_evictions == 2 and stats.dir_files == 3
    assert stats.dir_bytes <= stats.dir_max_bytes
    survivor, _ = process(tmp_path)
    for index in (0, 4):
        encode(survivor, index)
    assert survivor.encoder_runs == 0
    encode(survivor, 1)
    assert survivor.encoder_runs == 1  # evicted


def test_a_method_returning_an_object_no_file_can_hold_still_files_its_encoders_output(tmp_path) -> None:
    """What is kept is what the text encoder returned; the method runs on every call and makes its object anew,
    as uncached."""

    class Opaque:
        pass

    class OpaquePipeline(TokenIdTextPipeline):
        def encode_prompt(self, prompt_ids, attention_mask=None):
            return super().encode_prompt(prompt_ids, attention_mask), Opaque()

    pipeline = OpaquePipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(directory=tmp_path))
    first = pipeline.encode_prompt(PROMPTS[0], torch.ones_like(PROMPTS[0]))
    again = pipeline.encode_prompt(PROMPTS[0], torch.ones_like(PROMPTS[0]))
    assert pipeline.encoder_runs == 1 and same(again[0], first[0]) and same(first[0], reference(0))
    assert isinstance(again[1], Opaque) and again[1] is not first[1]  # made by the method, on every call
    assert cache.snapshot().dir_off_reason is None and len(files(tmp_path)) == 1


def test_a_value_no_file_can_hold_turns_the_directory_off_with_a_reason(tmp_path) -> None:
    class Opaque:
        pass

    pipeline, cache = process(tmp_path)
    encode(pipeline, 0)
    _write(cache.directory, ("opaque",), (b"",), (Opaque(),))
    assert "which a file cannot hold" in cache.snapshot().dir_off_reason
    assert same(encode(pipeline, 0), reference(0)) and same(encode(pipeline, 1), reference(1))
    assert pipeline.encoder_runs == 2  # memory still serves
    assert len(files(tmp_path)) == 1  # nothing written since


def test_a_pipeline_without_a_text_encoder_module_does_not_use_the_directory(tmp_path) -> None:
    class NoEncoder:
        def encode_prompt(self, prompt: str) -> torch.Tensor:
            return torch.zeros(2)

    pipeline = NoEncoder()
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(directory=tmp_path))
    pipeline.encode_prompt("a fox")
    assert "no text-encoder module" in cache.snapshot().dir_off_reason
    assert files(tmp_path) == []


def test_rows_of_a_batched_call_are_files_of_their_own(tmp_path) -> None:
    """Each row of a batched encoder call (cut as given, padding included) is an entry, and a file, of its own."""
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    uncached = QwenStyleTokenPipeline(build_qwen2_encoder()).encode_prompt(ids, mask)
    writer = QwenStyleTokenPipeline(build_qwen2_encoder())
    install_prompt_embed_cache(writer, settings=PromptEmbedCacheSettings(directory=tmp_path))
    expected = writer.encode_prompt(ids, mask)
    assert same(expected, uncached)
    reader = QwenStyleTokenPipeline(build_qwen2_encoder())  # another process, the same weights
    cache = install_prompt_embed_cache(reader, settings=PromptEmbedCacheSettings(directory=tmp_path))
    swapped = reader.encode_prompt(ids.flip(0), mask.flip(0))  # the same rows, in the other order
    # The rows kept are each row encoded alone (the writer's check): the reader is served those, bit for bit.
    alone = [
        QwenStyleTokenPipeline(build_qwen2_encoder()).encode_prompt(ids[row : row + 1], mask[row : row + 1])
        for row in (1, 0)
    ]
    assert torch.equal(swapped[0][0, :2], alone[0][0][0, :2]) and torch.equal(swapped[0][1, :3], alone[1][0][0, :3])
    assert reader.encoder_rows == 0 and cache.snapshot().dir_hits == 2
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(swapped[0].flip(0), expected[0], strict=True))


def test_rows_found_in_the_directory_are_not_encoded_once_the_readers_rows_were_checked(tmp_path) -> None:
    """A process checks that its encoder's rows are independent on its first batched call (served uncached);
    from then on the rows another process filed are read, not encoded."""
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    writer = QwenStyleTokenPipeline(build_qwen2_encoder())
    install_prompt_embed_cache(writer, settings=PromptEmbedCacheSettings(directory=tmp_path))
    expected = writer.encode_prompt(ids, mask)
    reader = QwenStyleTokenPipeline(build_qwen2_encoder())  # another process, the same weights
    cache = install_prompt_embed_cache(reader, settings=PromptEmbedCacheSettings(directory=tmp_path))
    other = torch.tensor([[11, 12, 13, 14], [15, 16, 17, 0]])
    reader.encode_prompt(other, (other != 0).long())  # its first batched call: the rows check
    assert cache.snapshot().layout_checks == 1
    reader.encoder_rows = 0
    swapped = reader.encode_prompt(ids.flip(0), mask.flip(0))
    assert reader.encoder_rows == 0 and cache.snapshot().dir_hits == 2
    # The rows kept are each row encoded alone (the writer's check): the reader is served those, bit for bit.
    alone = [
        QwenStyleTokenPipeline(build_qwen2_encoder()).encode_prompt(ids[row : row + 1], mask[row : row + 1])
        for row in (1, 0)
    ]
    assert torch.equal(swapped[0][0, :2], alone[0][0][0, :2]) and torch.equal(swapped[0][1, :3], alone[1][0][0, :3])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(swapped[0].flip(0), expected[0], strict=True))


def _waits_for_the_other(encoder: torch.nn.Module, other_waits: threading.Event) -> None:
    """Let ``encoder``'s forward begin only once ``other_waits`` is set: the other "process" is waiting for this
    one's file (the encode method runs on every call; the encoder call is what the directory's claim guards)."""

    def wait(*_: object) -> None:
        assert other_waits.wait(10), "the other process never waited"

    encoder.register_forward_pre_hook(wait)


def test_two_processes_missing_one_prompt_at_once_encode_it_once(tmp_path, monkeypatch) -> None:
    from vllm_omni_prompt_cache.store.tiers import directory_claims

    real_sleep = time.sleep
    other_waits = threading.Event()

    def sleep_and_say(seconds: float) -> None:  # only the claim wait sleeps in directory_claims
        other_waits.set()
        real_sleep(seconds)

    monkeypatch.setattr(
        directory_claims, "time", SimpleNamespace(time=time.time, monotonic=time.monotonic, sleep=sleep_and_say)
    )
    pipelines = [TokenIdTextPipeline(build_qwen2_encoder()) for _ in range(2)]  # the same weights, as two processes
    for pipeline in pipelines:
        _waits_for_the_other(pipeline.text_encoder, other_waits)
    caches = [
        install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(directory=tmp_path))
        for pipeline in pipelines
    ]
    results: list = [None, None]

    def one(index: int) -> None:
        results[index] = encode(pipelines[index], 0)

    threads = [threading.Thread(target=one, args=(index,), daemon=True) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a call hung"
    assert sum(pipeline.encoder_runs for pipeline in pipelines) == 1
    assert same(results[0], results[1]) and same(results[0], reference(0))
    assert sum(cache.snapshot().dir_waits for cache in caches) == 1
    assert not list(tmp_path.glob("*/*.claim"))  # released once written


def test_a_claim_that_is_never_released_delays_a_miss_but_never_blocks_it(tmp_path) -> None:
    crashed, crashed_cache = process(tmp_path)
    crashed_cache.directory.get(_key_of(crashed, 0))  # claims prompt 0, then "crashes" before encoding
    assert len(list(tmp_path.glob("*/*.claim"))) == 1
    waiter, cache = process(tmp_path)
    cache.directory.claims.wait_s = 0.2
    (claim,) = tmp_path.glob("*/*.claim")
    os.utime(claim)  # claimed just now: the waiter waits its 0.2 s
    began = time.monotonic()
    assert same(encode(waiter, 0), reference(0))
    assert 0.15 <= time.monotonic() - began < 5 and waiter.encoder_runs == 1
    crashed_cache.directory.get(_key_of(crashed, 1))  # another claim left behind, found old
    (claim,) = tmp_path.glob("*/*.claim")
    os.utime(claim, (time.time() - 60, time.time() - 60))
    later, _ = process(tmp_path)  # waits up to 10 s for a live claim
    began = time.monotonic()
    assert same(encode(later, 1), reference(1))
    assert time.monotonic() - began < 5  # taken over at once, not waited for
    assert not list(tmp_path.glob("*/*.claim"))


def _key_of(pipeline: TokenIdTextPipeline, index: int) -> CallKey:
    """Return the key of the text-encoder call that encoding prompt ``index`` makes (entries are keyed per encoder
    call): the same in every process of this pipeline class, seen on a probe of it."""
    return _key_and_entry_of(pipeline, index)[0]


def _key_and_entry_of(pipeline: TokenIdTextPipeline, index: int, seed: int = 0) -> tuple[CallKey, tuple]:
    """Return that key and its entry (what the text encoder returned), made by a probe (weights from ``seed``)."""
    probe = type(pipeline)(build_qwen2_encoder(seed=seed))
    cache = install_prompt_embed_cache(probe)
    keys: list[CallKey] = []
    serve = cache.lookups.serve
    cache.lookups.serve = lambda key, *args, **kwargs: (keys.append(key), serve(key, *args, **kwargs))[1]
    encode(probe, index)
    (key,) = keys
    found, entry = cache.lookups.get(key, "probe")
    assert found
    return key, entry


def same_entry(left: tuple, right: tuple) -> bool:
    """Whether two entries (what a text encoder returned: tag, form, leaves) hold the same leaves, bit for bit."""
    return (
        left[:2] == right[:2]
        and len(left[2]) == len(right[2])
        and all(
            (a is None and b is None)
            or (a is not None and b is not None and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
            for a, b in zip(left[2], right[2], strict=True)
        )
    )


def _write(
    tier: DirectoryTier, identity: tuple, witness: tuple[bytes, ...], value: Any, epoch: int | None = None
) -> None:
    """Write an entry's file as the write-through of an encode begun at ``epoch`` (None: now) does."""
    tier.put(identity, Entry(value, witness, 0), Stamp(Ticket(), tier.epoch if epoch is None else epoch))


def test_a_stage_of_several_ranks_keeps_the_directory_off_and_the_host_tier_on(tmp_path, caplog) -> None:
    from vllm_omni_prompt_cache import PromptEmbedCacheSettings
    from vllm_omni_prompt_cache.vllm_omni import runner

    settings = PromptEmbedCacheSettings(enabled=True, host_bytes=2**20, directory=str(tmp_path))
    # After an engine ran in this process our logger may not propagate, at vLLM's level (see
    # plugin.show_logs_as_vllm_does): listen on it directly, at WARNING.
    caplog.set_level(logging.WARNING, logger="vllm_omni_prompt_cache")
    ours = logging.getLogger("vllm_omni_prompt_cache")
    ours.addHandler(caplog.handler)
    try:
        several = runner.install_for_stage(TokenIdTextPipeline(build_qwen2_encoder()), settings, "tiny", ranks=2)
    finally:
        ours.removeHandler(caplog.handler)
    assert several.directory is None and several.host is not None
    assert "runs on 2 ranks" in caplog.text
    one = runner.install_for_stage(TokenIdTextPipeline(build_qwen2_encoder()), settings, "tiny", ranks=1)
    assert one.directory is not None


def test_sleep_level_one_keeps_entries_in_host_memory_and_level_two_clears_every_tier(tmp_path) -> None:
    """The worker's sleep wrapper on vLLM-Omni's level argument; the real worker's sleep is in test_tiers_e2e."""
    from types import SimpleNamespace

    from vllm_omni_prompt_cache.vllm_omni.lifecycle import _clearing_before_sleep

    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(
        pipeline, settings=PromptEmbedCacheSettings(host_bytes=2**20, directory=tmp_path)
    )
    worker = SimpleNamespace(model_runner=SimpleNamespace(pipeline=pipeline))
    sleep = _clearing_before_sleep(lambda self, level=1: level)
    encode(pipeline, 0)
    namespace = cache.directory.namespace
    assert sleep(worker, 1) == 1
    assert (len(cache), len(cache.host)) == (0, 1)
    encode(pipeline, 0)
    assert sleep(worker, level=2) == 2
    assert (len(cache), len(cache.host)) == (0, 0)
    assert cache.directory.current_namespace is None  # fingerprinted again on next use
    assert cache.directory.namespace == namespace  # the same weights came back: the same files


# --- faults inside this process: nothing raises into encode_prompt, nothing stale is served ----


def test_a_fingerprint_that_raises_leaves_the_directory_unused_and_the_call_served(tmp_path, monkeypatch) -> None:
    from vllm_omni_prompt_cache.encoders import fingerprint

    def unreadable(module):
        raise RuntimeError("weights are sharded")

    monkeypatch.setattr(fingerprint, "weights_digest", unreadable)
    pipeline, cache = process(tmp_path)
    assert same(encode(pipeline, 0), reference(0))
    assert "the fingerprint failed (RuntimeError: weights are sharded)" in cache.snapshot().dir_off_reason
    encode(pipeline, 1)
    assert files(tmp_path) == [] and pipeline.encoder_runs == 2


def test_a_host_copy_that_fails_drops_the_entry_and_raises_nothing(monkeypatch) -> None:
    from vllm_omni_prompt_cache.store.tiers import host as host_tier

    def no_pinned_memory(value):
        raise RuntimeError("CUDA error: out of memory (pinned)")

    monkeypatch.setattr(host_tier, "to_host", no_pinned_memory)
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, max_size=1, settings=PromptEmbedCacheSettings(host_bytes=2**20))
    encode(pipeline, 0)
    encode(pipeline, 1)  # prompt 0 leaves device memory; the host cannot take it
    assert cache.release_device_memory() == 1  # neither can it at sleep: still no error
    assert len(cache.host) == 0 and same(encode(pipeline, 0), reference(0))


def test_an_entry_leaving_device_memory_before_a_clear_never_arrives_after_it() -> None:
    """The host copy runs outside the store's lock; a clear() meanwhile makes the entry stale: the
    ticket it left under goes stale (as PromptEmbedCache.clear() does, before the host tier empties)."""
    from vllm_omni_prompt_cache.store.tiers.host import HostTier

    host = HostTier(2**20)
    ticket = Ticket()  # the store's ticket when the entry left device memory
    ticket.weights.stale = True  # new weights, while the copy was running
    host.clear()
    host.put(("tag", "prompt"), Entry(torch.ones(2), None, 8), Stamp(ticket, 0))
    assert len(host) == 0 and host.counts()[HOST_DEMOTIONS] == 0
    host.put(("tag", "prompt"), Entry(torch.ones(2), None, 8), Stamp(Ticket(), 0))
    assert len(host) == 1


def test_an_entry_leaving_before_a_sleep_and_a_clear_never_arrives_after_them(monkeypatch) -> None:
    """The host copy of an evicted entry is still running while the worker sleeps and then gets new
    weights: the sleep's ticket shares the old weights, and the clear makes every ticket of them stale."""
    from vllm_omni_prompt_cache.store.tiers.host import HostTier

    def sig(prompt_ids):
        """A one-argument encode's signature, for its keys."""

    builder = CallKeyBuilder(inspect.signature(sig), "tiny")
    cache = PromptEmbedCache(max_size=1, host_bytes=2**20)
    real_put, interrupted = HostTier.put, []

    def put_after_a_sleep_and_a_clear(self, *args) -> None:
        if not interrupted:  # the first copy: the one that left before both
            interrupted.append(True)
            cache.release_device_memory()
            cache.clear()
        real_put(self, *args)

    monkeypatch.setattr(HostTier, "put", put_after_a_sleep_and_a_clear)
    cache.put(builder.build((torch.tensor([1]),), {}), torch.ones(2))
    cache.put(builder.build((torch.tensor([2]),), {}), torch.ones(2))  # evicts the first
    assert interrupted and len(cache.host) == 0


def test_a_result_encoded_before_new_weights_is_never_written_under_their_namespace(tmp_path) -> None:
    pipeline, cache = process(tmp_path)
    tier = cache.directory
    identity, witness = _key_of(pipeline, 0)
    epoch = tier.epoch  # when the encode began
    tier.clear()  # new weights arrive before the write
    _write(tier, identity, tuple(part.tobytes() for part in witness), reference(0), epoch)
    assert files(tmp_path) == []
    _write(tier, identity, tuple(part.tobytes() for part in witness), reference(0), tier.epoch)
    assert len(files(tmp_path)) == 1


def test_empty_key_bytes_are_stored_and_checked(tmp_path) -> None:
    _, cache = process(tmp_path)
    identity = ("tiny", ("tensor", torch.int64, torch.Size([1, 0]), b"digest"))
    _write(cache.directory, identity, (b"",), (torch.zeros(1, 0, 4),))
    assert cache.directory.get(CallKey(identity, (b"",)), claim=False)[0]
    assert not cache.directory.get(CallKey(identity, (b"x",)), claim=False)[0]  # other bytes: refused
    assert cache.snapshot().dir_write_errors == 0


def test_a_writer_without_verification_still_gives_readers_the_key_bytes(tmp_path) -> None:
    encoder = build_qwen2_encoder()
    writer = TokenIdTextPipeline(encoder)
    install_prompt_embed_cache(
        writer,
        settings=PromptEmbedCacheSettings(directory=tmp_path, verify=False, digest=lambda data: b"same"),
    )
    encode(writer, 0)
    reader = TokenIdTextPipeline(encoder)
    cache = install_prompt_embed_cache(
        reader, settings=PromptEmbedCacheSettings(directory=tmp_path, digest=lambda data: b"same")
    )
    assert same(encode(reader, 1), reference(1))  # prompt 0's file, under prompt 1's colliding name
    assert cache.snapshot().dir_rejections == {WITNESS: 1}


def test_damaged_metadata_is_caught_by_the_checksum(tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save

    writer, _ = process(tmp_path)
    encode(writer, 0)
    (path,) = files(tmp_path)
    with safe_open(str(path), "pt") as opened:
        metadata = dict(opened.metadata())
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118
    metadata["structure"] = metadata["structure"].replace('"tensor": 0', '"tensor": 1', 1)  # outputs swapped
    path.write_bytes(save(tensors, metadata))
    reader, cache = process(tmp_path)
    assert same(encode(reader, 0), reference(0))
    assert cache.snapshot().dir_rejections == {CHECKSUM: 1}


def test_a_file_this_process_cannot_place_is_a_miss_and_stays_for_others(tmp_path) -> None:
    writer, _ = process(tmp_path)
    encode(writer, 0)
    reader, cache = process(tmp_path)

    def no_memory(recorded):
        raise torch.OutOfMemoryError("no device memory left")

    cache.directory.local_device = no_memory
    assert same(encode(reader, 0), reference(0)) and reader.encoder_runs == 1
    stats = cache.snapshot()
    assert (stats.dir_hits, stats.dir_rejections) == (0, {})
    assert len(files(tmp_path)) == 1


def test_the_budget_never_touches_files_it_did_not_write(tmp_path) -> None:
    probe, _ = process(tmp_path / "probe")
    encode(probe, 0)
    entry_bytes = files(tmp_path / "probe")[0].stat().st_size
    shutil.rmtree(tmp_path / "probe")
    checkpoint = tmp_path / "Qwen-Image" / "transformer"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"\0" * 50_000)
    (tmp_path / "notes.safetensors").write_bytes(b"\0" * 50_000)
    writer, cache = process(tmp_path, directory_bytes=entry_bytes * 3 // 2)  # room for one entry
    for index in range(3):
        encode(writer, index)
    stats = cache.snapshot()
    assert (stats.dir_writes, stats.dir_evictions, stats.dir_files) == (3, 2, 1)
    assert (checkpoint / "model.safetensors").stat().st_size == 50_000
    assert (tmp_path / "notes.safetensors").exists()
    writer, cache = process(tmp_path, directory_bytes=1)  # an entry larger than the whole budget
    encode(writer, 5)
    assert cache.snapshot().dir_write_errors == 1 and len(files(tmp_path)) == 1


def test_a_directory_that_cannot_be_written_leaves_every_call_served(tmp_path) -> None:
    """A root under a regular file: making the namespace directory fails (what a read-only mount does)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(directory=blocker / "embeddings"))
    done = threading.Event()

    def calls() -> None:
        for index in (0, 0, 1):
            encode(pipeline, index)
        cache.clear()  # takes the directory tier's lock after the store's: neither may be left held
        encode(pipeline, 2)
        done.set()

    worker = threading.Thread(target=calls, daemon=True)
    worker.start()
    assert done.wait(30), "a call hung"
    stats = cache.snapshot()
    assert pipeline.encoder_runs == 3 and stats.hits == 1 and stats.dir_write_errors == 3


def test_load_weights_suspends_the_directory_until_the_load_ends(tmp_path) -> None:
    from vllm_omni_prompt_cache.vllm_omni.lifecycle import watch_weight_loads

    seen_during_load: list = []

    class Loading(TokenIdTextPipeline):
        def load_weights(self, weights):
            for name, tensor in weights:
                seen_during_load.append(self._prompt_embed_cache.directory.namespace)  # what an encode would get
                with torch.no_grad():
                    self.get_parameter(name).copy_(tensor)

    pipeline = Loading(build_qwen2_encoder())
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(directory=tmp_path))
    watch_weight_loads(pipeline)
    encode(pipeline, 0)
    before = cache.directory.namespace
    embedding = pipeline.text_encoder.embed_tokens.weight
    pipeline.load_weights([("text_encoder.embed_tokens.weight", embedding.detach() * 2)])
    assert seen_during_load == [None]  # no namespace while weights change: nothing read or written
    after = cache.directory.namespace
    assert after is not None and after != before  # the new weights' own namespace
    twin = build_qwen2_encoder()  # the loaded weights in an encoder of its own: the pipeline's calls are served
    twin.load_state_dict(pipeline.text_encoder.state_dict())
    assert same(encode(pipeline, 0), encode(TokenIdTextPipeline(twin), 0))


def test_weights_offloaded_layer_by_layer_are_not_fingerprinted(tmp_path) -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    pipeline.text_encoder.layers[0]._omni_layerwise_enabled = True  # as vLLM-Omni's layerwise offload marks it
    cache = install_prompt_embed_cache(pipeline, settings=PromptEmbedCacheSettings(directory=tmp_path))
    assert same(encode(pipeline, 0), reference(0))
    assert "not readable (offloaded or discarded)" in cache.snapshot().dir_off_reason
    assert files(tmp_path) == []


def test_an_encode_voided_by_a_clear_keeps_its_hands_off_the_next_encodes_claim(tmp_path) -> None:
    pipeline, cache = process(tmp_path)
    tier = cache.directory
    tier.claims.wait_s = 0.2
    key = _key_of(pipeline, 0)
    identity = key.identity
    old_epoch = tier.epoch
    assert not tier.get(key, epoch=old_epoch)[0]  # claims it; then a clear voids the encode
    cache.clear()  # same weights: the same namespace, the same claim file
    new_epoch = tier.epoch
    assert not tier.get(key, epoch=new_epoch)[0]  # the next encode takes the claim over
    (claim,) = tmp_path.glob("*/*.claim")
    tier.release(identity, old_epoch)  # the voided encode ends
    assert claim.exists()  # the next encode's claim stays
    tier.release(identity, new_epoch)
    assert not claim.exists()
