"""Packed shards of the directory tier: many entries a file, an index, read in place (RFC #450's layout).

Real caches on a real encoder (a tiny Qwen2 text model) write the entry files; ``pack`` moves them into
shards; a new "process" (another pipeline and cache on the same root) reads them back.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.store.tiers.directory_files import DAMAGED_SHARD, REFUSED_PACKED
from vllm_omni_prompt_cache.store.tiers.directory_shards import INDEX, SHARDS, ShardError, pack, read_index, verify
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder

PROMPTS = [torch.tensor([[3, 1, 4, 1, 5, 9, i]]) for i in range(12)]


def encode(pipeline: TokenIdTextPipeline, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = PROMPTS[index]
    return pipeline.encode_prompt(ids.clone(), torch.ones_like(ids))


def process(root: Path, **kwargs):
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    return pipeline, install_prompt_embed_cache(
        pipeline, max_size=32, settings=PromptEmbedCacheSettings(directory=root, **kwargs)
    )


def filled(root: Path, count: int = 8, **kwargs) -> tuple[Path, str, list]:
    """Encode ``count`` prompts into the directory at ``root``; return the namespace directory, namespace, outputs."""
    pipeline, cache = process(root, **kwargs)
    outputs = [encode(pipeline, index) for index in range(count)]
    namespace = cache.directory.namespace
    return root / namespace, namespace, outputs


def entry_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def same(left: tuple, right: tuple) -> bool:
    return all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(left, right, strict=True))


def test_packed_entries_are_served_in_place_by_a_new_process_without_per_entry_files(tmp_path) -> None:
    directory, namespace, outputs = filled(tmp_path)
    assert len(entry_files(directory)) == 8
    report = pack(directory, namespace, shard_bytes=3 * max(path.stat().st_size for path in entry_files(directory)))
    assert (report.packed, report.files_removed, report.entries, report.shards) == (8, 8, 8, 3)
    assert entry_files(directory) == []  # no small file per entry left
    assert sorted(path.name for path in (directory / SHARDS).iterdir()) == [
        INDEX,
        "shard-00000.pack",
        "shard-00001.pack",
        "shard-00002.pack",
    ]
    pipeline, cache = process(tmp_path)
    assert all(same(encode(pipeline, index), outputs[index]) for index in range(8))
    stats = cache.snapshot()
    assert (pipeline.encoder_runs, stats.dir_hits, stats.dir_rejections) == (0, 8, {})
    assert verify(directory, namespace) == []


def test_a_second_pack_adds_a_shard_and_an_interrupted_one_is_resumed(tmp_path, monkeypatch) -> None:
    directory, namespace, _ = filled(tmp_path, 4)
    pack(directory, namespace)
    pipeline, _ = process(tmp_path)
    for index in range(4, 8):  # new prompts: files of their own again
        encode(pipeline, index)
    import vllm_omni_prompt_cache.store.tiers.directory_shards as module

    written = module._write_durably

    def index_write_fails(path: Path, parts) -> None:
        if path.name == INDEX:
            raise OSError(28, "No space left on device")
        written(path, parts)

    monkeypatch.setattr(module, "_write_durably", index_write_fails)
    with pytest.raises(OSError):
        pack(directory, namespace)
    assert len(entry_files(directory)) == 4  # nothing removed: no index names their bytes
    assert len(read_index(directory / SHARDS, namespace)) == 4  # the old index is whole
    monkeypatch.setattr(module, "_write_durably", written)
    report = pack(directory, namespace)  # resume
    assert (report.packed, report.unindexed_removed, report.entries, report.shards) == (4, 1, 8, 2)
    fresh, cache = process(tmp_path)
    for index in range(8):
        encode(fresh, index)
    assert (fresh.encoder_runs, cache.snapshot().dir_hits) == (0, 8)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_damaged_shard_names_itself_and_serves_nothing(tmp_path, caplog, damage) -> None:
    directory, namespace, outputs = filled(tmp_path, 6)
    pack(directory, namespace)  # one shard holds all six
    shard = directory / SHARDS / "shard-00000.pack"
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        shard.write_bytes(bytes(data[: len(data) // 2]))  # a write cut short: the last entries are missing
    else:
        data[len(data) - 10] ^= 0xFF  # inside the last entry only
        shard.write_bytes(bytes(data))
    caplog.set_level(logging.ERROR)
    pipeline, cache = process(tmp_path)
    served = [encode(pipeline, index) for index in range(6)]
    assert all(same(served[index], outputs[index]) for index in range(6))  # never a wrong embedding
    assert any(str(shard) in message and "damaged" in message for message in caplog.messages)
    stats = cache.snapshot()
    # The first entries precede the damage, but once the shard is found damaged nothing more is read from it.
    assert stats.dir_rejections == {DAMAGED_SHARD: 1}
    assert pipeline.encoder_runs == 6 - stats.dir_hits and stats.dir_hits < 6
    assert shard.exists()  # read-only data: never removed by a reader
    problems = verify(directory, namespace)
    assert len(problems) == 1 and str(shard) in problems[0]


def test_a_packed_entry_that_fails_the_file_checks_is_refused_alone(tmp_path) -> None:
    """Bytes that match the index but not the entry's own checks (the index rewritten to match) are refused;
    the shard's other entries still serve."""
    directory, namespace, outputs = filled(tmp_path, 2)
    pack(directory, namespace)
    shard = directory / SHARDS / "shard-00000.pack"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    index_path = directory / SHARDS / INDEX
    index = json.loads(index_path.read_text())
    import xxhash

    for where in index["entries"].values():
        where[3] = xxhash.xxh3_128_hexdigest(bytes(data[where[1] : where[1] + where[2]]))
    index_path.write_text(json.dumps(index))
    pipeline, cache = process(tmp_path)
    served = [encode(pipeline, index) for index in range(2)]
    assert all(same(served[index], outputs[index]) for index in range(2))
    stats = cache.snapshot()
    assert (stats.dir_rejections, stats.dir_hits, pipeline.encoder_runs) == ({REFUSED_PACKED: 1}, 1, 1)


def test_files_written_again_after_a_shard_was_damaged_are_packed_anew(tmp_path) -> None:
    """A damaged shard's prompts are encoded again and written as files; the next pack keeps their new bytes
    (it must not take them for leftovers of the first pack) and a new process hits them all."""
    directory, namespace, outputs = filled(tmp_path, 4)
    pack(directory, namespace)
    shard = directory / SHARDS / "shard-00000.pack"
    shard.write_bytes(shard.read_bytes()[:10])  # truncated: nothing of it serves
    damaged, _ = process(tmp_path)
    for index in range(4):
        encode(damaged, index)
    assert damaged.encoder_runs == 4 and len(entry_files(directory)) == 4  # written again, as files
    report = pack(directory, namespace)
    assert (report.packed, report.files_removed, report.entries) == (4, 4, 4)
    fresh, cache = process(tmp_path)
    assert all(same(encode(fresh, index), outputs[index]) for index in range(4))
    assert (fresh.encoder_runs, cache.snapshot().dir_hits, cache.snapshot().dir_rejections) == (0, 4, {})


def test_a_pack_reads_no_link_and_writes_nothing_others_may_change(tmp_path) -> None:
    directory, namespace, _ = filled(tmp_path, 2)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not an entry")
    (directory / ("0" * 40 + ".safetensors")).symlink_to(secret)
    report = pack(directory, namespace)
    assert report.packed == 2  # the link was not followed
    assert b"not an entry" not in (directory / SHARDS / "shard-00000.pack").read_bytes()
    for path in (directory / SHARDS, directory / SHARDS / INDEX, directory / SHARDS / "shard-00000.pack"):
        assert path.stat().st_mode & 0o022 == 0, path


@pytest.mark.parametrize(
    "entry",
    [
        ["../../elsewhere.pack", 0, 10, "0" * 32],
        ["shard-00000.pack", -1, 10, "0" * 32],
        ["shard-00000.pack", 0, 2**40, "0" * 32],
        ["shard-00000.pack", 0, 10, "not a digest"],
        ["shard-00000.pack", 0],
    ],
)
def test_an_index_naming_anything_but_a_shard_range_is_refused_naming_it(tmp_path, entry) -> None:
    directory, namespace, _ = filled(tmp_path, 1)
    pack(directory, namespace)
    index_path = directory / SHARDS / INDEX
    index = json.loads(index_path.read_text())
    index["entries"]["a" * 40 + ".safetensors"] = entry
    index_path.write_text(json.dumps(index))
    with pytest.raises(ShardError, match=f"{index_path}: entry"):
        read_index(directory / SHARDS, namespace)


def test_a_signed_directorys_shards_are_refused_under_another_key(tmp_path) -> None:
    directory, namespace, outputs = filled(tmp_path, 3, directory_key=b"k" * 32)
    pack(directory, namespace)
    signed, _ = process(tmp_path, directory_key=b"k" * 32)
    assert all(same(encode(signed, index), outputs[index]) for index in range(3))
    assert signed.encoder_runs == 0
    other, other_cache = process(tmp_path, directory_key=b"x" * 32)
    for index in range(3):
        encode(other, index)
    assert other.encoder_runs == 3 and other_cache.snapshot().dir_hits == 0


def test_one_pack_at_a_time_and_an_index_of_another_namespace_is_refused(tmp_path) -> None:
    directory, namespace, _ = filled(tmp_path, 2)
    (directory / SHARDS).mkdir()
    (directory / SHARDS / "pack.lock").touch()
    with pytest.raises(ShardError, match="another pack of this namespace is running"):
        pack(directory, namespace)
    (directory / SHARDS / "pack.lock").unlink()
    pack(directory, namespace)
    with pytest.raises(ShardError, match="written for namespace"):
        read_index(directory / SHARDS, "0" * 32)
    with pytest.raises(ValueError, match="shard_bytes"):
        pack(directory, namespace, shard_bytes=0)


def test_readers_during_later_packs_never_find_a_shard_damaged(tmp_path) -> None:
    """Four threads read packed entries while two more packs run: a new index keeps the descriptors of the
    shards it still names, so no read fails or marks a healthy shard damaged."""
    import threading

    from vllm_omni_prompt_cache.store.tiers.directory_shards import Shards

    directory, namespace, _ = filled(tmp_path, 4)
    pack(directory, namespace)
    names = list(read_index(directory / SHARDS, namespace))
    expected = {name: Shards(directory, namespace).read(name) for name in names}
    shards = Shards(directory, namespace)
    problems: list[object] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for name in names:
                try:
                    if shards.read(name, fresh=True) != expected[name]:
                        problems.append(name)
                except ShardError as error:
                    problems.append(error)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for thread in threads:
        thread.start()
    writer, _ = process(tmp_path)
    for index in range(4, 10):
        encode(writer, index)
        if index in (6, 9):
            pack(directory, namespace)
    stop.set()
    for thread in threads:
        thread.join()
    assert problems == []
    assert len(read_index(directory / SHARDS, namespace)) == 10
