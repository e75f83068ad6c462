"""The tiny Qwen-Image checkpoint: built once from configs, reused, and checked before use."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("diffusers", reason="building the tiny model needs the vllm-omni extra")

from vllm_omni_prompt_cache.tiny.qwen_image import (
    PROMPT_TEMPLATE,
    TEMPLATE_DROP_TOKENS,
    TinyQwenImageSpec,
    check_model_dir,
    ensure_tiny_qwen_image,
    load_tokenizer,
    prompt_token_ids,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("models")
    return cache_dir, ensure_tiny_qwen_image(TinyQwenImageSpec(), cache_dir=cache_dir)


def test_build_writes_a_diffusers_checkpoint(built) -> None:
    _, model_dir = built
    assert check_model_dir(model_dir) == model_dir
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert json.loads((model_dir / "tiny_spec.json").read_text())["text_hidden_size"] == 64


def test_second_call_reuses_the_build(built) -> None:
    cache_dir, model_dir = built
    stamp = os.stat(model_dir / "model_index.json").st_mtime_ns
    assert ensure_tiny_qwen_image(TinyQwenImageSpec(), cache_dir=cache_dir) == model_dir
    assert os.stat(model_dir / "model_index.json").st_mtime_ns == stamp


def test_each_size_gets_its_own_directory() -> None:
    assert TinyQwenImageSpec().digest() != TinyQwenImageSpec(text_layers=3).digest()
    assert TinyQwenImageSpec().digest() == TinyQwenImageSpec().digest()


def test_template_tokenizes_to_more_tokens_than_qwen_image_drops(built) -> None:
    _, model_dir = built
    tokenizer = load_tokenizer(model_dir)
    assert len(prompt_token_ids(tokenizer, "")) > TEMPLATE_DROP_TOKENS
    ids = prompt_token_ids(tokenizer, "a red fox")
    assert tokenizer.decode(ids) == PROMPT_TEMPLATE.format("a red fox")


def test_bad_model_directories_fail_clearly(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_dir(tmp_path / "missing")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        check_model_dir(a_file)
    with pytest.raises(FileNotFoundError, match=r"no model_index\.json"):
        check_model_dir(tmp_path)
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="lacks the sub-folders"):
        check_model_dir(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory; permissions cannot be tested as root")
def test_unreadable_model_directory_fails_clearly(built, tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        with pytest.raises(PermissionError, match="is not readable"):
            check_model_dir(locked)
    finally:
        locked.chmod(0o700)
