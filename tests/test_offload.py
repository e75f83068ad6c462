"""The text encoder's moves under vLLM-Omni's module offload, and the encoder placed only for a miss.

Real modules (a tiny transformers Qwen2 encoder behind a token-ID ``encode_prompt``, a linear
"DiT"), vLLM-Omni's real ``apply_sequential_offload`` hooks, this package's real worker install
(``runner.install_for_stage``). Where a test needs the hooks to target a GPU it builds them with a
``cuda`` device: registering a hook allocates nothing, and nothing here runs them; that is the one
stand-in for the GPU this machine lacks, and each such test says so.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import pytest
import torch

from vllm_omni_prompt_cache.calls.wrapper import PLACEMENT_ATTRIBUTE
from vllm_omni_prompt_cache.counts.counters import BYTES_MOVED, BYTES_NOT_MOVED, DIT_EVICTIONS, PLACEMENTS_AVOIDED
from vllm_omni_prompt_cache.encoders.fingerprint import ENCODE_DEVICE, weights_digest
from vllm_omni_prompt_cache.encoders.residency import EncoderMoves, EncoderPlacement
from vllm_omni_prompt_cache.settings.resolved import resolve_settings
from vllm_omni_prompt_cache.settings.schema import ENCODER_ON_MISS, PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline, build_qwen2_encoder
from vllm_omni_prompt_cache.vllm_omni import runner

IDS = torch.tensor([[5, 6, 7, 8]])
OTHER_IDS = torch.tensor([[9, 10, 11]])


def offloaded_pipeline(device: str = "cpu", components: tuple[str, ...] = ("dit", "text_encoder")) -> Any:
    """A token-ID pipeline with a DiT, under vLLM-Omni's module offload hooks (as ``enable()`` registers them)."""
    from vllm_omni.diffusion.offloader.sequential_backend import apply_sequential_offload

    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    pipeline.transformer = torch.nn.Linear(64, 64)
    apply_sequential_offload(
        dit_modules=[pipeline.transformer],
        encoder_modules=[pipeline.text_encoder],
        device=torch.device(device),
        pin_memory=False,
        offload_dit_modules=[pipeline.transformer] if "dit" in components else [],
        offload_encoder_modules=[pipeline.text_encoder] if "text_encoder" in components else [],
    )
    return pipeline


def settings(**given: Any) -> Any:
    return resolve_settings({"enable_prompt_embed_cache": True, **given}, environ={})


def description(cache: Any) -> dict[str, Any]:
    namespace = cache.directory.namespace
    return json.loads((cache.directory.root / namespace / "NAMESPACE.json").read_text())


def test_the_fingerprint_names_where_an_offloaded_encoder_runs_not_where_it_waits(tmp_path) -> None:
    """Bug: the namespace held the devices the encoder's parameters sat on, the host between requests
    under module offload, so a re-fingerprint then named another namespace than one taken while the
    encoder was placed. (GPU stand-in: the hooks target cuda:1; nothing runs them.)"""
    pipeline = offloaded_pipeline("cuda:1")
    cache = runner.install_for_stage(pipeline, settings(prompt_embed_cache_dir=str(tmp_path)), "tiny")
    assert description(cache)["devices"] == ["cuda"]


def test_a_file_lands_where_the_offloaded_encoder_runs(tmp_path) -> None:
    """Bug: a file's tensors went to the encoder's first parameter's device, the host between requests
    under module offload, then to the writer's device index. (GPU stand-in: hooks target cuda:1.)"""
    pipeline = offloaded_pipeline("cuda:1")
    cache = runner.install_for_stage(pipeline, settings(prompt_embed_cache_dir=str(tmp_path)), "tiny")
    assert cache.directory.local_device("cuda:3") == torch.device("cuda", 1)
    assert cache.directory.local_device("cpu") == torch.device("cpu")


def test_module_offload_moves_are_counted_and_a_hit_moves_nothing() -> None:
    pipeline = offloaded_pipeline()
    cache = runner.install_for_stage(pipeline, settings(), "tiny")
    encoder_bytes = sum(t.nbytes for t in (*pipeline.text_encoder.parameters(), *pipeline.text_encoder.buffers()))
    dit_bytes = sum(t.nbytes for t in pipeline.transformer.parameters())

    def request(ids: torch.Tensor) -> torch.Tensor:
        embeds, _ = pipeline.encode_prompt(ids)
        with torch.inference_mode():
            return pipeline.transformer(embeds)  # the DiT's forward: its hook swaps back

    request(IDS)  # a miss: the encoder's hook evicts the DiT (both start placed, as enable() leaves them)
    stats = cache.stats()
    assert (stats["dit_evictions"], stats["encoder_placements"], stats["encoder_evictions"]) == (1, 0, 1)
    request(OTHER_IDS)  # a miss again: the encoder comes back, the DiT leaves, then the reverse
    stats = cache.stats()
    assert (stats["encoder_placements"], stats["dit_evictions"], stats["dit_placements"]) == (1, 2, 2)
    assert stats["bytes_moved"] == 2 * encoder_bytes + encoder_bytes + 4 * dit_bytes  # encoder 2 out, 1 in; DiT 2+2
    moved = stats["bytes_moved"]
    request(IDS)  # a hit: no encoder forward, nothing moves
    stats = cache.stats()
    assert stats["encoder_placements"] == 1 and stats["bytes_moved"] == moved
    assert stats["placements_avoided"] == 1
    assert stats["bytes_not_moved"] == 2 * (encoder_bytes + dit_bytes)  # there and back, both modules
    assert stats["encoder_placer"] == "vllm-omni module offload"
    assert stats["encoder_device_bytes"] == 0  # the DiT's forward ran last: the encoder is on the host


def test_the_encoder_waits_in_host_memory_and_is_placed_only_while_a_miss_encodes() -> None:
    reference = TokenIdTextPipeline(build_qwen2_encoder())
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = runner.install_for_stage(pipeline, settings(prompt_embed_cache_encoder_on_miss=True), "tiny")
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE)
    seen_during_forward: list[int] = []
    pipeline.text_encoder.register_forward_hook(lambda *_: seen_during_forward.append(placement.device_bytes()))

    assert placement.device_bytes() == 0  # parked from install on
    first = pipeline.encode_prompt(IDS)
    assert seen_during_forward and seen_during_forward[0] == placement.host_bytes() > 0  # placed for the miss
    assert placement.device_bytes() == 0  # and back in the masters after it
    again = pipeline.encode_prompt(IDS)  # a hit: no forward, nothing placed
    assert len(seen_during_forward) == 1
    expected = reference.encode_prompt(IDS)
    assert all(torch.equal(a, b) for a, b in zip(first, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    stats = cache.stats()
    assert (stats["encoder_placements"], stats["encoder_evictions"], stats["placements_avoided"]) == (1, 1, 1)
    assert stats["encoder_placer"] == "on a miss" and stats["encoder_device_bytes"] == 0
    assert stats["bytes_not_moved"] == placement.host_bytes()


def test_weights_written_between_calls_reach_the_next_miss_and_the_fingerprint_reads_the_masters() -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    before = weights_digest(pipeline.text_encoder)
    runner.install_for_stage(pipeline, settings(prompt_embed_cache_encoder_on_miss=True), "tiny")
    assert weights_digest(pipeline.text_encoder) == before  # read from the host masters
    new = build_qwen2_encoder(seed=7)
    with torch.no_grad():  # a weight load writes in place (vLLM's weight_loader: param.data.copy_)
        for mine, theirs in zip(pipeline.text_encoder.parameters(), new.parameters(), strict=True):
            mine.data.copy_(theirs.data)
        # and a replaced parameter object is adopted on the next placement
        pipeline.text_encoder.norm.weight = torch.nn.Parameter(new.norm.weight.detach().clone())
    got = pipeline.encode_prompt(OTHER_IDS)
    expected = TokenIdTextPipeline(new).encode_prompt(OTHER_IDS)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert getattr(pipeline, PLACEMENT_ATTRIBUTE).device_bytes() == 0


def test_a_stray_forward_is_placed_for_its_length_and_settled_before_weights_load() -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    runner.install_for_stage(pipeline, settings(prompt_embed_cache_encoder_on_miss=True), "tiny")
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE)
    during: list[int] = []
    pipeline.text_encoder.layers[0].register_forward_hook(lambda *_: during.append(placement.device_bytes()))
    pipeline.text_encoder(input_ids=IDS)  # a whole encoder's forward outside any cached call
    assert placement.stray_placements == 1 and during == [placement.host_bytes()]
    assert placement.device_bytes() == 0  # it left when that forward returned
    pipeline.text_encoder.embed_tokens(IDS)  # a part of it: placed, and it stays...
    assert placement.stray_placements == 2 and placement.device_bytes() > 0
    placement.settle()  # ...until a weight load or a sleep settles it (lifecycle.py calls this)
    assert placement.device_bytes() == 0


def test_the_memory_profile_runs_every_encode_as_a_miss_with_the_encoders_placed() -> None:
    """vLLM-Omni's profile_run, wrapped as the worker has it: a cached prompt is encoded again, placed."""
    from types import SimpleNamespace

    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    cache = runner.install_for_stage(pipeline, settings(prompt_embed_cache_encoder_on_miss=True), "tiny")
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE)
    pipeline.encode_prompt(IDS)  # cached now
    placed_during: list[int] = []
    pipeline.text_encoder.register_forward_hook(lambda *_: placed_during.append(placement.device_bytes()))

    def profile_run(model_runner: Any, requests: list) -> None:
        model_runner.pipeline.encode_prompt(IDS)

    runner._profiling_as_misses(profile_run)(SimpleNamespace(pipeline=pipeline), [])
    assert placed_during == [placement.host_bytes()] and placement.device_bytes() == 0
    assert cache.enabled and cache.stats()["bypass_reasons"] == {"cache disabled": 1}


class TwoTextEncoders(TokenIdTextPipeline):
    """Two text encoders (as FLUX's CLIP and T5), a DiT, and a module named beside them that runs after
    the encode (as LTX-2's ``connectors``): only the two whose input is token ids are text encoders."""

    def __init__(self) -> None:
        super().__init__(build_qwen2_encoder())
        self.text_encoder_2 = build_qwen2_encoder(seed=1)
        self.connectors = torch.nn.Linear(64, 64)
        self._encoder_modules = ("text_encoder", "text_encoder_2", "connectors")

    def encode_prompt(self, prompt_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        first, mask = super().encode_prompt(prompt_ids, *args, **kwargs)
        second = self.text_encoder_2(input_ids=prompt_ids).last_hidden_state
        return first + second, mask


def test_two_text_encoders_share_one_dit_swap_in_the_bytes_not_moved() -> None:
    from vllm_omni.diffusion.offloader.sequential_backend import apply_sequential_offload

    pipeline = TwoTextEncoders()
    pipeline.transformer = torch.nn.Linear(64, 64)
    encoders = [pipeline.text_encoder, pipeline.text_encoder_2]
    apply_sequential_offload([pipeline.transformer], encoders, torch.device("cpu"), pin_memory=False)
    cache = runner.install_for_stage(pipeline, settings(), "tiny")
    nbytes = {module: sum(t.nbytes for t in (*module.parameters(), *module.buffers())) for module in encoders}
    dit_bytes = sum(t.nbytes for t in pipeline.transformer.parameters())
    moved_by_encodes = []
    for ids in (IDS, IDS):  # a miss, then a hit
        before = cache.stats()["bytes_moved"]
        embeds, _ = pipeline.encode_prompt(ids)
        moved_by_encodes.append(cache.stats()["bytes_moved"] - before)
        with torch.inference_mode():
            pipeline.transformer(embeds)
    stats = cache.stats()
    assert moved_by_encodes[0] > 0 and moved_by_encodes[1] == 0  # the hit's encoder calls, all answered, moved nothing
    assert stats["placements_avoided"] == 2  # both encoders would have been placed
    assert stats["bytes_not_moved"] == 2 * sum(nbytes.values()) + 2 * dit_bytes  # the DiT once, not per encoder


def test_a_hit_then_a_miss_in_one_request_avoided_nothing() -> None:
    """A prompt that hits and a negative prompt that misses, before one DiT forward: the encoder is
    placed anyway, so the hit spared no placement."""
    pipeline = offloaded_pipeline()
    cache = runner.install_for_stage(pipeline, settings(), "tiny")
    embeds, _ = pipeline.encode_prompt(IDS)
    with torch.inference_mode():
        pipeline.transformer(embeds)
    pipeline.encode_prompt(IDS)  # hit
    embeds, _ = pipeline.encode_prompt(OTHER_IDS)  # miss: the encoder is placed
    with torch.inference_mode():
        pipeline.transformer(embeds)
    stats = cache.stats()
    assert stats["encoder_placements"] == 1 and stats["placements_avoided"] == 0 and stats["bytes_not_moved"] == 0


def test_only_text_encoders_are_placed_on_a_miss() -> None:
    pipeline = TwoTextEncoders()
    runner.install_for_stage(pipeline, settings(prompt_embed_cache_encoder_on_miss=True), "tiny")
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE)
    assert set(placement.encoders) == {"text_encoder", "text_encoder_2"}
    pipeline.encode_prompt(IDS)
    with torch.inference_mode():
        pipeline.connectors(torch.zeros(1, 64))  # runs after the encode, as LTX-2's connectors do
    assert placement.stray_placements == 0 and placement.device_bytes() == 0


def test_installing_twice_keeps_one_placement_and_its_counts() -> None:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    given = settings(prompt_embed_cache_encoder_on_miss=True)
    cache = runner.install_for_stage(pipeline, given, "tiny")
    placement, moves = getattr(pipeline, PLACEMENT_ATTRIBUTE), cache.moves
    pipeline.encode_prompt(IDS)
    assert runner.install_for_stage(pipeline, given, "tiny") is cache
    assert getattr(pipeline, PLACEMENT_ATTRIBUTE) is placement and cache.moves is moves
    assert cache.stats()["encoder_placements"] == 1


def test_uninstall_puts_the_encoder_back_for_good() -> None:
    from vllm_omni_prompt_cache import uninstall_prompt_embed_cache

    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    runner.install_for_stage(pipeline, settings(prompt_embed_cache_encoder_on_miss=True), "tiny")
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE)
    masters = {
        id(tensor): master.data_ptr()
        for tensor, master in zip(placement._tensors(), placement._masters.values(), strict=True)
    }
    uninstall_prompt_embed_cache(pipeline)
    assert not hasattr(pipeline, PLACEMENT_ATTRIBUTE)
    assert all(tensor.data_ptr() != masters[id(tensor)] for tensor in pipeline.text_encoder.parameters())
    assert not hasattr(pipeline.text_encoder, ENCODE_DEVICE)
    pipeline.text_encoder(input_ids=IDS)
    assert placement.stray_placements == 0  # its hooks are gone


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: offloaded_pipeline(), "module offload moves text_encoder itself"),
        (lambda: _lora_on_encoder(), "LoRA on its text encoders"),
    ],
    ids=["module-offload-of-the-encoder", "lora-on-the-encoder"],
)
def test_a_combination_that_cannot_work_is_refused_naming_the_setting_and_source(make, expected) -> None:
    given = settings(prompt_embed_cache_encoder_on_miss=True)
    with pytest.raises(PromptEmbedCacheConfigError) as raised:
        runner.install_for_stage(make(), given, "tiny")
    message = str(raised.value)
    assert f"invalid {ENCODER_ON_MISS.name}=True from keyword argument {ENCODER_ON_MISS.name}" in message
    assert expected in message


def _lora_on_encoder() -> Any:
    pipeline = TokenIdTextPipeline(build_qwen2_encoder())
    pipeline._lora_components = ("text_encoder",)
    return pipeline


def test_offload_of_the_dit_alone_works_with_the_encoder_placed_on_a_miss() -> None:
    pipeline = offloaded_pipeline(components=("dit",))
    cache = runner.install_for_stage(pipeline, settings(prompt_embed_cache_encoder_on_miss=True), "tiny")
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE)
    dit_bytes = sum(t.nbytes for t in pipeline.transformer.parameters())
    for _ in range(2):  # a miss, then a hit
        embeds, _ = pipeline.encode_prompt(IDS)
        with torch.inference_mode():
            pipeline.transformer(embeds)
    stats = cache.stats()
    assert stats["encoder_placer"] == "vllm-omni module offload + on a miss"
    assert (stats["encoder_placements"], stats["encoder_evictions"]) == (1, 1)
    assert (stats["dit_evictions"], stats["dit_placements"]) == (1, 1)  # the miss's encode swapped the DiT
    assert stats["encoder_device_bytes"] == 0
    assert stats["bytes_not_moved"] == placement.host_bytes() + 2 * dit_bytes  # the hit: encoder in, DiT out and in


def test_a_spared_placement_is_counted_with_its_bytes_and_moves_survive_since_and_merged() -> None:
    from vllm_omni_prompt_cache.store.prompt_embed_cache import CacheStats

    moves = EncoderMoves()
    placement = EncoderPlacement({"text_encoder": build_qwen2_encoder()}, torch.device("cpu"), moves)
    moves.moved(encoder=False, placed=False, nbytes=10)
    moves.served_without_encoding()  # the placement's source: one placement of every encoder spared
    counts = moves.counts()
    assert (counts[DIT_EVICTIONS], counts[BYTES_MOVED]) == (1, 10)
    assert (counts[PLACEMENTS_AVOIDED], counts[BYTES_NOT_MOVED]) == (1, placement.host_bytes())
    first = CacheStats(dit_evictions=1, bytes_moved=10, encoder_device_bytes=0)
    second = CacheStats(dit_evictions=3, bytes_moved=30, encoder_device_bytes=5)
    assert second.since(first).dit_evictions == 2
    assert CacheStats.merged([first, second]).encoder_device_bytes == 5


_PLACED_AT_ENTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ReadsTheEncoderDeviceFirst(TokenIdTextPipeline):
    """Reads where its encoder is before running it, as vLLM-Omni's ByT5 glyph encoder does
    (``next(self.text_encoder.parameters()).device``, ``ming_flash_omni/byte5_encoder.py``), and
    records how many encoder bytes were placed then."""

    @property
    def placed_at_entry(self) -> list[int]:
        """Kept outside the instance, as the encoder counters are: an instrument, not state the encode reads."""
        return _PLACED_AT_ENTRY.setdefault(self, [])

    def encode_prompt(self, prompt_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        placement = getattr(self, PLACEMENT_ATTRIBUTE)
        self.placed_at_entry.append(placement.device_bytes())
        return super().encode_prompt(prompt_ids.to(self.text_encoder.device), *args, **kwargs)


def test_an_encode_that_reads_the_encoders_device_first_is_placed_only_for_its_miss() -> None:
    """The method runs for real on every call: it sees the encoder waiting in host memory, its miss's encoder call
    is placed (the inputs it put there follow the encoder), and its hit places nothing."""
    reference = TokenIdTextPipeline(build_qwen2_encoder())
    pipeline = ReadsTheEncoderDeviceFirst(build_qwen2_encoder())
    cache = runner.install_for_stage(pipeline, settings(prompt_embed_cache_encoder_on_miss=True), "tiny")
    placement = getattr(pipeline, PLACEMENT_ATTRIBUTE)
    during: list[int] = []
    pipeline.text_encoder.register_forward_hook(lambda *_: during.append(placement.device_bytes()))
    first = pipeline.encode_prompt(IDS)  # a miss: the encoder is placed for its forward
    again = pipeline.encode_prompt(IDS)  # a hit: no forward, nothing placed
    expected = reference.encode_prompt(IDS)
    assert all(torch.equal(a, b) for a, b in zip(first, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(again, expected, strict=True))
    assert pipeline.placed_at_entry == [0, 0]  # placed at the miss's encoder call, not at the method's entry
    assert during == [placement.host_bytes()] and placement.device_bytes() == 0
    stats = cache.stats()
    assert (stats["encoder_placements"], stats["encoder_evictions"], stats["placements_avoided"]) == (1, 1, 1)
