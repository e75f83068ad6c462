"""The tiers below device memory through the real ``AsyncOmni`` engine on CPU: sleep and wake
between rollout steps, a restarted engine on a directory, and ``precompute``.

Encoder rows are counted by the tiny token-ID Qwen-Image pipeline itself (its worker extension),
whatever the cache says.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_support import run, tiny_spec

from vllm_omni_prompt_cache import cli
from vllm_omni_prompt_cache.demo.rollout import engine_kwargs, send_rollout
from vllm_omni_prompt_cache.tiny.qwen_image import load_tokenizer, prompt_token_ids
from vllm_omni_prompt_cache.vllm_omni.engine_client import open_engine, worker_value

STEP_1 = ("a red fox in the snow", "a lighthouse above a stormy sea")
STEP_2 = ("a bowl of ramen on a wooden table", "a paper boat on a puddle")


async def rows_encoded(engine) -> int:
    return int((await worker_value(engine, "text_encoder_counters"))["encoder_rows"])


@pytest.mark.engine
def test_a_host_tier_carries_step_one_across_two_sleeps(tmp_path) -> None:
    """Step 1, sleep, wake, step 2, sleep, wake, step 3 = step 1's prompts and seeds: no encode, same latents."""
    first, second = tiny_spec(prompts=STEP_1, group_size=2), tiny_spec(prompts=STEP_2, group_size=2)
    kwargs = {
        **engine_kwargs(first, "ours", 16, None),
        "prompt_embed_cache_host_bytes": "16MiB",
        "enable_sleep_mode": True,
    }

    async def scenario() -> dict:
        seen: dict = {}
        async with open_engine(kwargs) as engine:
            start = await rows_encoded(engine)
            seen["step 1"] = await send_rollout(engine, first)
            seen["rows 1"] = await rows_encoded(engine) - start
            await engine.sleep(level=1)
            seen["asleep"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await engine.wake_up()
            start = await rows_encoded(engine)
            await send_rollout(engine, second)
            seen["rows 2"] = await rows_encoded(engine) - start
            await engine.sleep(level=1)
            await engine.wake_up()
            start = await rows_encoded(engine)
            seen["step 3"] = await send_rollout(engine, first)
            seen["rows 3"] = await rows_encoded(engine) - start
            seen["stats"] = await worker_value(engine, "get_prompt_embed_cache_stats")
            await engine.sleep(level=2)  # discards the weights: what comes back is unknown (AsyncOmni cannot wake)
            seen["deep sleep"] = await worker_value(engine, "get_prompt_embed_cache_stats")
        return seen

    seen = run(scenario())
    assert seen["rows 1"] == len(STEP_1) + 1  # each prompt and the shared negative prompt, once
    assert (seen["asleep"]["size"], seen["asleep"]["bytes"]) == (0, 0)  # sleep frees the device tier
    assert seen["asleep"]["host_entries"] == len(STEP_1) + 2  # and the warm-up prompt
    assert seen["rows 2"] == len(STEP_2)  # the negative prompt came back from host memory
    assert seen["rows 3"] == 0
    assert seen["stats"]["host_hits"] >= len(STEP_1) + 2
    assert (seen["deep sleep"]["size"], seen["deep sleep"]["host_entries"]) == (0, 0)
    latents_1, latents_3 = seen["step 1"].latents, seen["step 3"].latents
    assert latents_1.keys() == latents_3.keys()
    assert all(torch.equal(latents_1[index], latents_3[index]) for index in latents_1)


@pytest.mark.engine
def test_precompute_then_a_restarted_engine_on_the_directory_encodes_nothing(tmp_path, capfd) -> None:
    spec = tiny_spec(prompts=STEP_1, group_size=2)
    directory = tmp_path / "embeddings"
    tokenizer = load_tokenizer(spec.model_dir)
    negative = prompt_token_ids(tokenizer, spec.negative_prompt)
    prompt_file = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt_token_ids": prompt_token_ids(tokenizer, text), "negative_prompt_ids": negative} for text in STEP_1
    ]
    prompt_file.write_text("".join(json.dumps(line) + "\n" for line in [*lines, lines[0]]))  # one twice
    reference_kwargs = engine_kwargs(spec, "off", 16, None)
    engine_args = {
        key: value for key, value in reference_kwargs.items() if key not in ("model", "enable_prompt_embed_cache")
    }
    argv = [
        "precompute",
        "--model", str(spec.model_dir),
        "--prompts", str(prompt_file),
        "--cache-dir", str(directory),
        "--batch-size", "2",
        "--sampling-params", json.dumps({"true_cfg_scale": spec.true_cfg_scale, "height": 64, "width": 64}),
        "--engine-args", json.dumps(engine_args),
        "--no-progress",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    first = capfd.readouterr().out
    assert "2 prompts, 0 already done, 2 sent" in first and "3 files written" in first  # two prompts, one negative
    assert cli.main(argv) == 0
    assert "2 prompts, 2 already done, 0 sent" in capfd.readouterr().out  # resumed: nothing left to do

    async def rollout(kwargs: dict) -> tuple:
        async with open_engine(kwargs) as engine:
            start = await rows_encoded(engine)
            sent = await send_rollout(engine, spec)
            return sent, await rows_encoded(engine) - start, await worker_value(engine, "get_prompt_embed_cache_stats")

    restarted, rows, stats = run(
        rollout({**engine_kwargs(spec, "ours", 16, None), "prompt_embed_cache_dir": str(directory)})
    )
    assert rows == 0
    # The prompts, the negative prompt and the engine's warm-up prompt (the precompute engine wrote it too): an
    # encoder call's key is what reaches the encoder, the same in every process from the first call on.
    assert stats["dir_hits"] == len(STEP_1) + 2 and stats["dir_rejections"] == {}
    reference, reference_rows, _ = run(rollout(reference_kwargs))
    assert reference_rows == len(spec.requests()) * 2  # no cache: a prompt and a negative prompt per request
    assert all(torch.equal(restarted.latents[index], reference.latents[index]) for index in reference.latents)


def test_precompute_refuses_a_bad_prompt_file_naming_the_line(tmp_path, capfd) -> None:
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text('"a fox"\n\n[1, 2, "three"]\n')
    argv = ["precompute", "--model", "unused", "--prompts", str(prompt_file), "--cache-dir", str(tmp_path / "d")]
    assert cli.main(argv) == 2
    assert f"{prompt_file}:3: expected a JSON string" in capfd.readouterr().err


def tamper_entry_files(namespace_directory) -> int:
    """Rewrite every entry file with its first value tensor changed and every check of a file still passing
    (checksum recomputed): what a nondeterministic encoder or a bug upstream of the write would leave."""
    from safetensors.torch import load, save

    from vllm_omni_prompt_cache.store.tiers.directory_files import checksum_of, read_metadata

    changed = 0
    for path in sorted(namespace_directory.glob("*.safetensors")):
        data = path.read_bytes()
        metadata, tensors = read_metadata(data), load(data)
        if not metadata.get("tensors") or int(metadata["tensors"]) == 0:
            continue
        tensors["value.0"] = tensors["value.0"] + 1
        values = [tensors[f"value.{i}"] for i in range(int(metadata["tensors"]))]
        kept = [tensors[f"witness.{i}"] for i in range(int(metadata["witness"]))]
        metadata["checksum"] = checksum_of(values + kept, metadata)
        path.write_bytes(save(tensors, metadata))
        changed += 1
    return changed


@pytest.mark.engine
def test_precompute_reads_parquet_packs_shards_and_its_parity_check_fails_on_a_difference(tmp_path, capfd) -> None:
    """RFC #450's flow: a parquet dataset in, shards out (no per-entry files), a parity check that exits 1 when
    a stored entry differs from a fresh encode, and when a damaged shard leaves a prompt unserved."""
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    from vllm_omni_prompt_cache.store.tiers.directory_shards import SHARDS

    spec = tiny_spec(prompts=STEP_1, group_size=2)
    tokenizer = load_tokenizer(spec.model_dir)
    negative = prompt_token_ids(tokenizer, spec.negative_prompt)
    dataset = tmp_path / "train.parquet"
    rows = {"prompt": [prompt_token_ids(tokenizer, text) for text in STEP_1], "negative_prompt": [negative] * 2}
    parquet.write_table(pyarrow.table(rows), dataset)
    reference_kwargs = engine_kwargs(spec, "off", 16, None)
    engine_args = {
        key: value for key, value in reference_kwargs.items() if key not in ("model", "enable_prompt_embed_cache")
    }

    def precompute(directory, *extra: str) -> tuple[int, str]:
        argv = [
            "precompute",
            "--model", str(spec.model_dir),
            "--prompts", str(dataset),
            "--negative-prompt-column", "negative_prompt",
            "--cache-dir", str(directory),
            "--sampling-params", json.dumps({"true_cfg_scale": spec.true_cfg_scale, "height": 64, "width": 64}),
            "--engine-args", json.dumps(engine_args),
            "--no-progress",
            *extra,
        ]  # fmt: skip
        code = cli.main(argv)
        return code, capfd.readouterr().out

    good = tmp_path / "good"
    code, out = precompute(good, "--pack", "--parity-sample", "2")
    assert code == 0, out
    assert "2 prompts, 0 already done, 2 sent" in out and "parity passed: 2 stored prompts sent again" in out
    (namespace_directory,) = [path for path in good.iterdir() if path.is_dir()]
    # Packed: no file per entry; the one file is the parity engine's start-up warm-up, encoded after the pack.
    assert len(list(namespace_directory.glob("*.safetensors"))) <= 1
    assert len(list((namespace_directory / SHARDS).glob("shard-*.pack"))) == 1
    assert "pack: 4 entry files moved into 1 new shards" in out  # 2 prompts, the negative, the warm-up

    shard = next((namespace_directory / SHARDS).glob("shard-*.pack"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out = precompute(good, "--parity-sample", "2")  # every prompt done: a check alone
    assert code == 1 and "parity FAILED" in out and "2 prompts, 2 already done, 0 sent" in out

    tampered = tmp_path / "tampered"
    assert precompute(tampered)[0] == 0
    (namespace_directory,) = [path for path in tampered.iterdir() if path.is_dir()]
    assert tamper_entry_files(namespace_directory) >= 3  # the two prompts and the negative prompt
    code, out = precompute(tampered, "--pack", "--parity-sample", "2")
    assert code == 1 and "parity FAILED" in out
    assert " 0 differed" not in out


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--shard-bytes", "0", "--shard-bytes"),
        ("--shard-bytes", "abc", "--shard-bytes"),
        ("--shard-bytes", "none", "--shard-bytes"),
        ("--parity-sample", "0", "--parity-sample"),
        ("--parity-sample", "-1", "--parity-sample"),
        ("--parity-seed", "x", "--parity-seed"),
        ("--prompt-column", " ", "--prompt-column"),
        ("--negative-prompt-column", "", "--negative-prompt-column"),
    ],
)
def test_precompute_refuses_a_bad_new_flag_naming_it(tmp_path, capfd, flag, value, named) -> None:
    argv = ["precompute", "--model", "m", "--prompts", "p.jsonl", "--cache-dir", str(tmp_path / "d"), flag, value]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert named in capfd.readouterr().err


def test_precompute_names_a_missing_parquet_column_and_reads_unirl_rows(tmp_path, capfd) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    from vllm_omni_prompt_cache.vllm_omni.prompt_files import read_prompts

    dataset = tmp_path / "train.parquet"
    chat = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a red fox"}]]
    parquet.write_table(pyarrow.table({"prompt": chat, "data_source": ["ocr"]}), dataset)
    assert read_prompts(dataset) == ["a red fox"]  # verl-omni's chat list: its user message's text
    argv = ["precompute", "--model", "m", "--prompts", str(dataset), "--cache-dir", str(tmp_path / "d")]
    assert cli.main([*argv, "--prompt-column", "caption"]) == 2
    assert "no column 'caption'; its columns: prompt, data_source" in capfd.readouterr().err
    lines = tmp_path / "unirl.jsonl"
    lines.write_text('{"prompt_id": 1, "prompt": "a red fox", "metadata": {}}\n{"prompt_id": 2, "caption": "x"}\n')
    assert cli.main(["precompute", "--model", "m", "--prompts", str(lines), "--cache-dir", str(tmp_path / "d"),
                     "--prompt-column", "prompt"]) == 2  # fmt: skip
    assert f"{lines}:2: no 'prompt' field (--prompt-column)" in capfd.readouterr().err
    lines.write_text('{"prompt_id": 1, "prompt": "a red fox", "metadata": {}}\n')
    assert read_prompts(lines, prompt_column="prompt") == ["a red fox"]


@pytest.mark.parametrize(
    ("flag", "value", "needs"), [("--shard-bytes", "1GiB", "--pack"), ("--parity-seed", "3", "--parity-sample")]
)
def test_precompute_refuses_a_flag_that_would_change_nothing(tmp_path, capfd, flag, value, needs) -> None:
    argv = ["precompute", "--model", "m", "--prompts", "p.jsonl", "--cache-dir", str(tmp_path / "d"), flag, value]
    assert cli.main(argv) == 2
    assert f"precompute: {flag} applies with {needs} only" in capfd.readouterr().err
