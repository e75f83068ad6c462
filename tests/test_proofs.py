"""How a row layout earns trust: the first-use check, inference from a call, refutation.

Real tensors and a real (tiny, random) transformers Qwen2 encoder; the pipelines are small
classes around it whose ``encode_prompt`` signatures nobody registered.
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_omni_prompt_cache import RowLayout, RowOutput, install_prompt_embed_cache
from vllm_omni_prompt_cache.calls.method_calls import WholeCalls
from vllm_omni_prompt_cache.calls.row_calls import RowCalls
from vllm_omni_prompt_cache.rows.layout_proofs import GAP_TOLERANCE, compare_outputs, infer_layout
from vllm_omni_prompt_cache.settings.resolved import PromptEmbedCacheSettings
from vllm_omni_prompt_cache.tiny.text_encoder import QwenStyleTokenPipeline, build_qwen2_encoder


@pytest.fixture(scope="module")
def encoder() -> torch.nn.Module:
    return build_qwen2_encoder(seed=3)


def collate(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded int64 ids and a bool mask, as an RL adapter collates a request batch."""
    ids = torch.zeros(len(rows), max(len(row) for row in rows), dtype=torch.int64)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
    return ids, ids != 0


def token_rows(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 12, (count,), generator=generator).tolist()
    return [torch.randint(1, 1000, (length,), generator=generator).tolist() for length in lengths]


class TeamPipeline(QwenStyleTokenPipeline):
    """A token-ID adapter with its own parameter names and an extra argument (registered nowhere)."""

    def encode_prompt(self, input_ids, input_mask=None, images_per_prompt=1, max_tokens=1024, output_dtype=None):
        mask = torch.ones_like(input_ids, dtype=torch.bool) if input_mask is None else input_mask
        embeds, embeds_mask = super().encode_prompt(input_ids, mask, images_per_prompt, max_tokens)
        return (embeds if output_dtype is None else embeds.to(output_dtype)), embeds_mask


class TilingPipeline(QwenStyleTokenPipeline):
    """Copies the whole batch (r0, r1, r0, r1), as ``repeat`` does, instead of each row."""

    def encode_prompt(self, input_ids, input_mask, copies=1):
        embeds, mask = super().encode_prompt(input_ids, input_mask, 1)
        return embeds.repeat(copies, 1, 1), mask.repeat(copies, 1)


def copies_layout(order: str, name: str) -> RowLayout:
    """The layout of TilingPipeline's signature, with both outputs' copies in ``order``."""
    output = RowOutput(pad_dim=1, copies=order)
    return RowLayout(
        rows=("input_ids", "input_mask"), mask="input_mask", copies="copies", outputs=(output, output), name=name
    )


def path(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


# compare_outputs -----------------------------------------------------------------------------------


def test_identical_outputs_match_with_no_gap() -> None:
    embeds, mask = torch.randn(3, 5, 8), torch.ones(3, 5, dtype=torch.long)
    assert compare_outputs((embeds.clone(), mask.clone()), (embeds, mask)) == (None, 0.0)


def test_a_gap_below_the_tolerance_is_measured_and_accepted() -> None:
    embeds = torch.randn(3, 5, 8)
    nudged = embeds.clone()
    nudged[1, 2, 3] += 1e-6 * embeds[1].abs().max()
    why, gap = compare_outputs(nudged, embeds)
    assert why is None and 0 < gap < GAP_TOLERANCE[torch.float32]


def test_another_rows_values_are_a_mismatch_naming_the_row() -> None:
    embeds = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    swapped = embeds[[0, 0, 2]]  # row 1 holds row 0's values
    why, gap = compare_outputs((swapped, torch.ones(3, 5)), (embeds, torch.ones(3, 5)))
    assert why is not None and why.startswith("output 0: row 1 differs by") and gap > 0.1


def test_dict_outputs_are_compared_by_key() -> None:
    """Anima's encode_prompt returns a dict: compared value by value, never by a tensor's truth value."""
    embeds = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    expected = {"embeds": embeds, "mask": torch.ones(2, 4, dtype=torch.long)}
    assert compare_outputs({k: v.clone() for k, v in expected.items()}, expected) == (None, 0.0)
    why, _ = compare_outputs({"embeds": embeds.flip(0), "mask": expected["mask"]}, expected)
    assert why is not None and why.startswith("output 'embeds': row 0 differs by")
    assert "other keys" in compare_outputs({"embeds": embeds}, expected)[0]


def test_masks_and_shapes_must_be_equal() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert compare_outputs(mask.flip(0), mask)[0] == "values differ"
    assert "shape (2, 2)" in compare_outputs(mask[:, :2], mask)[0]
    assert "torch.int32" in compare_outputs(mask.int(), mask)[0]
    assert "returned 2 values" in compare_outputs((mask,), (mask, mask))[0]


def test_bf16_gets_its_own_wider_tolerance() -> None:
    embeds = torch.randn(2, 4, 8).to(torch.bfloat16)
    rounded = (embeds.float() * (1 + 2**-7)).to(torch.bfloat16)  # about one bf16 step everywhere
    why, gap = compare_outputs(rounded, embeds)
    assert why is None and gap > GAP_TOLERANCE[torch.float32]


# infer_layout ------------------------------------------------------------------------------------------


def bound(pipeline, *args, **kwargs) -> dict:
    import inspect

    signature = inspect.signature(pipeline.encode_prompt)
    arguments = signature.bind(*args, **kwargs)
    arguments.apply_defaults()
    return signature, dict(arguments.arguments)


def test_a_token_adapter_layout_is_inferred_from_a_call_and_its_output(encoder) -> None:
    pipeline = TeamPipeline(encoder)
    ids, mask = collate(token_rows(3, seed=1))
    signature, arguments = bound(pipeline, ids, mask, images_per_prompt=2)
    layout = infer_layout(signature, arguments, pipeline.encode_prompt(ids, mask, images_per_prompt=2))
    assert layout == RowLayout(
        rows=("input_ids", "input_mask"),
        mask="input_mask",
        copies="images_per_prompt",
        outputs=(RowOutput(pad_dim=1, copies="interleave"), RowOutput(pad_dim=1, copies="interleave")),
        name="inferred (input_ids, input_mask; copies images_per_prompt)",
    )


def test_a_tiled_copy_order_is_inferred_as_tile(encoder) -> None:
    pipeline = TilingPipeline(encoder)
    ids, mask = collate(token_rows(2, seed=2))
    signature, arguments = bound(pipeline, ids, mask, copies=3)
    layout = infer_layout(signature, arguments, pipeline.encode_prompt(ids, mask, copies=3))
    assert [output.copies for output in layout.outputs] == ["tile", "tile"] and layout.copies == "copies"


def test_what_cannot_be_inferred_says_why(encoder) -> None:
    pipeline = TeamPipeline(encoder)
    ids, mask = collate(token_rows(2, seed=3))
    signature, arguments = bound(pipeline, ids[:1], mask[:1])
    assert infer_layout(signature, arguments, pipeline.encode_prompt(ids[:1], mask[:1])) == "one row: nothing to infer"
    signature, arguments = bound(pipeline, mask, mask)
    assert infer_layout(signature, arguments, (torch.zeros(2, 3),)) == (
        "several arguments could be the mask: ['input_ids', 'input_mask']"
    )
    signature, arguments = bound(pipeline, ids, mask)
    assert infer_layout(signature, arguments, "text") == "encode_prompt returned a str, not a tuple of tensors"
    assert infer_layout(signature, arguments, (torch.zeros(3, 4),)) == "outputs of [3] rows for 2 input rows"


# The first-use check, through the public install -----------------------------------------------------


def test_an_undeclared_adapter_gets_rows_after_its_first_batched_miss_proves_them(encoder) -> None:
    pipeline, reference = TeamPipeline(encoder), TeamPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    a, b, c = token_rows(3, seed=4)
    first = pipeline.encode_prompt(*collate([a, b, a, b]))
    assert pipeline.encoder_rows == 4 + 2  # the whole miss, then a and b alone to check the inferred layout
    stats = cache.snapshot()
    assert (stats.layout_checks, stats.layout_check_rows, stats.layout_mismatches) == (1, 4, 0)
    assert torch.equal(first[0], reference.encode_prompt(*collate([a, b, a, b]))[0])  # served uncached
    second = pipeline.encode_prompt(*collate([b, c, a]))
    assert pipeline.encoder_rows == 6 + 1  # only c: a and b are rows now
    expected = reference.encode_prompt(*collate([b, c, a]))
    torch.testing.assert_close(second, expected, rtol=0, atol=1e-5)
    assert cache.snapshot().layout_checks == 1  # the same kind: no second check


def test_the_strategy_is_chosen_at_install_and_changes_only_when_a_layout_is_adopted_or_refuted(encoder) -> None:
    undeclared = TeamPipeline(encoder)
    install_prompt_embed_cache(undeclared, max_size=16)
    calls = undeclared._prompt_embed_cache_installation.methods["encode_prompt"]
    assert type(calls.strategy) is WholeCalls and calls.strategy.infer  # no layout: keyed whole, one inferred
    a, b = token_rows(2, seed=4)
    undeclared.encode_prompt(*collate([a, b]))  # the inferred layout passed its check: adopted
    assert type(calls.strategy) is RowCalls and calls.strategy.layout is calls.proof.layout is not None

    wrong = TilingPipeline(encoder)
    interleaving = copies_layout("interleave", "interleaved copies")
    install_prompt_embed_cache(
        wrong,
        max_size=16,
        settings=PromptEmbedCacheSettings(row_layouts={path(TilingPipeline): interleaving}),
    )
    calls = wrong._prompt_embed_cache_installation.methods["encode_prompt"]
    assert type(calls.strategy) is RowCalls and calls.strategy.layout is interleaving
    wrong.encode_prompt(*collate([a, b]), copies=2)  # the check refutes it: whole calls from now on
    assert type(calls.strategy) is WholeCalls and not calls.strategy.infer and calls.proof.layout is None


def test_a_new_kind_of_call_is_checked_again(encoder) -> None:
    pipeline = TeamPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    a, b = token_rows(2, seed=5)
    pipeline.encode_prompt(*collate([a, b]))
    pipeline.encode_prompt(*collate([b, a]))
    assert cache.snapshot().layout_checks == 1
    pipeline.encode_prompt(*collate([a, b]), images_per_prompt=2)  # copies > 1: a new kind
    stats = cache.snapshot()
    assert stats.layout_checks == 2 and stats.layout_mismatches == 0
    runs = pipeline.encoder_runs
    pipeline.encode_prompt(*collate([b, a]), images_per_prompt=2)
    assert pipeline.encoder_runs == runs and cache.snapshot().layout_checks == 2


def test_a_repeated_row_is_covered_by_a_check_on_distinct_trimmed_rows(encoder) -> None:
    pipeline = TeamPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    a, b = token_rows(2, seed=6)
    pipeline.encode_prompt(*collate([a, b]))
    pipeline.encode_prompt(*collate([a, a, a]))
    assert cache.snapshot().layout_checks == 1


def test_a_wrong_user_declaration_is_caught_on_first_use_and_never_served(encoder, caplog) -> None:
    pipeline, reference = TilingPipeline(encoder), TilingPipeline(encoder)
    interleaving = copies_layout("interleave", "interleaved copies")
    cache = install_prompt_embed_cache(
        pipeline,
        max_size=16,
        settings=PromptEmbedCacheSettings(row_layouts={path(TilingPipeline): interleaving}),
    )
    rows = token_rows(2, seed=7)
    with caplog.at_level(logging.WARNING, logger="vllm_omni_prompt_cache.rows.layout_proofs"):
        outputs = [pipeline.encode_prompt(*collate(rows), copies=2) for _ in range(3)]
    expected = reference.encode_prompt(*collate(rows), copies=2)
    for embeds, mask in outputs:
        assert torch.equal(embeds, expected[0]) and torch.equal(mask, expected[1])
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "'interleaved copies'" in warnings[0] and path(TilingPipeline) in warnings[0]
    assert "prompt_embed_cache_row_layouts" in warnings[0]
    stats = cache.snapshot()
    assert (stats.layout_checks, stats.layout_mismatches) == (1, 1)
    assert stats.hits == 1 and stats.row_hits == 0  # the third call hit its whole-call key


def test_a_right_user_declaration_serves_rows_after_one_check(encoder) -> None:
    pipeline = TilingPipeline(encoder)
    tiling = copies_layout("tile", "tiled copies")
    cache = install_prompt_embed_cache(
        pipeline,
        max_size=16,
        settings=PromptEmbedCacheSettings(row_layouts={path(TilingPipeline): tiling}),
    )
    a, b, c = token_rows(3, seed=8)
    pipeline.encode_prompt(*collate([a, b]), copies=2)
    pipeline.encode_prompt(*collate([c, a]), copies=2)
    stats = cache.snapshot()
    assert (stats.layout_checks, stats.layout_mismatches, stats.rows_encoded) == (1, 0, 3)


class MixedCopiesPipeline(QwenStyleTokenPipeline):
    """Copies embeddings row by row but tiles the mask, as vLLM-Omni's stock Qwen-Image does."""

    def encode_prompt(self, input_ids, input_mask, copies=1):
        embeds, mask = super().encode_prompt(input_ids, input_mask, 1)
        return embeds.repeat_interleave(copies, dim=0), mask.repeat(copies, 1)


def test_a_check_whose_rows_could_not_tell_the_mask_order_apart_covers_nothing_beyond(encoder, caplog) -> None:
    """Equal-length rows have equal masks: the inferred mask order is unproven, and the next call
    whose masks differ is checked, caught, and served uncached."""
    pipeline, reference = MixedCopiesPipeline(encoder), MixedCopiesPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    generator = torch.Generator().manual_seed(9)
    same_length = [torch.randint(1, 1000, (7,), generator=generator).tolist() for _ in range(2)]
    first = pipeline.encode_prompt(*collate(same_length), copies=2)
    assert cache.snapshot().layout_checks == 1 and cache.snapshot().layout_mismatches == 0
    short, long = token_rows(1, seed=10)[0][:4], token_rows(1, seed=11)[0] + [5, 6, 7, 8]
    with caplog.at_level(logging.WARNING, logger="vllm_omni_prompt_cache.rows.layout_proofs"):
        second = pipeline.encode_prompt(*collate([short, long]), copies=2)
    for got, rows in ((first, same_length), (second, [short, long])):
        want = reference.encode_prompt(*collate(rows), copies=2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    stats = cache.snapshot()
    assert (stats.layout_checks, stats.layout_mismatches) == (2, 1)
    assert "output 1: values differ" in caplog.text


def test_a_row_call_that_raises_refutes_an_unchecked_layout_and_the_call_is_served(encoder) -> None:
    pipeline = TeamPipeline(encoder)
    wrong = RowLayout(rows=("input_ids",), outputs=(RowOutput(), RowOutput()), name="ids without their mask")
    cache = install_prompt_embed_cache(
        pipeline, max_size=16, settings=PromptEmbedCacheSettings(row_layouts={path(TeamPipeline): wrong})
    )
    rows = token_rows(2, seed=12)
    embeds, _ = pipeline.encode_prompt(*collate(rows))  # each row's ids beside the whole batch's mask
    assert torch.equal(embeds, TeamPipeline(encoder).encode_prompt(*collate(rows))[0])
    assert cache.snapshot().whole_call_reasons == {"row layout dropped: it did not match encode_prompt's outputs": 1}


def test_a_counted_call_is_a_miss_when_its_check_runs_the_encoder(encoder) -> None:
    pipeline = TeamPipeline(encoder)
    cache = install_prompt_embed_cache(pipeline, max_size=16)
    a, b = token_rows(2, seed=13)
    pipeline.encode_prompt(*collate([a, b]))  # inferred and checked
    pipeline.encode_prompt(*collate([b, a]))  # rows: a hit
    pipeline.encode_prompt(*collate([b, a]), images_per_prompt=2)  # rows cached, but a new kind: checked
    stats = cache.snapshot()
    assert (stats.hits, stats.misses, stats.layout_checks) == (1, 2, 2)
    assert stats.calls == 3


def test_infinities_and_nans_must_stand_in_the_same_places() -> None:
    """An additive attention mask holds -inf: equal outputs with it match; moved or changed, they differ."""
    masked = torch.tensor([[0.5, float("-inf"), float("nan")], [1.0, 2.0, float("inf")]])
    assert compare_outputs(masked.clone(), masked) == (None, 0.0)
    moved = masked.clone()
    moved[0, 0], moved[0, 1] = float("-inf"), 0.5
    assert compare_outputs(moved, masked)[0] == "non-finite values differ"
    flipped = masked.clone()
    flipped[1, 2] = float("-inf")
    assert compare_outputs(flipped, masked)[0] == "non-finite values differ"
    nudged = masked.clone()
    nudged[1, 0] = 1.5  # a finite value off by 25% of its row's largest finite value
    assert compare_outputs(nudged, masked)[0].startswith("row 1 differs")
