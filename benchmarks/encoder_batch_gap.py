"""How far one uncached batched encode is from encoding each row alone: the batch-invariance gap.

    python benchmarks/encoder_batch_gap.py

Row-level caching encodes every row alone, so a cached output is bit-identical to rows-alone
encoding by construction. This prints, per encoder and batch composition, how many rows of one
batched call came out bit-identical to the same rows encoded alone, and the max abs difference:
what the cache changes against an uncached request-batched call. Encoders: the demo model's text
encoder (Qwen2.5-VL text stack, hidden 384, 6 layers, fp32) and the test suite's Qwen2 (hidden 64,
2 layers, fp32), both with random weights, on this machine's CPU.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from vllm_omni_prompt_cache.demo.command import DEMO_MODEL
from vllm_omni_prompt_cache.demo.machine import cpu_summary
from vllm_omni_prompt_cache.demo.rollout import DEFAULT_PROMPTS, NEGATIVE_PROMPT
from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image, load_tokenizer, prompt_token_ids
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder


def hidden_rows(encoder: torch.nn.Module, rows: list[list[int]]) -> list[torch.Tensor]:
    """Encode ``rows`` as one right-padded batch; return each row's attended last hidden states."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(row)
        mask[index, : len(row)] = 1
    with torch.inference_mode():
        hidden = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    return [hidden[index, : len(row)] for index, row in enumerate(rows)]


def gap(encoder: torch.nn.Module, distinct: list[list[int]], batch: list[int]) -> tuple[int, float]:
    """Return (rows bit-identical to rows alone, max abs difference) for one batch of row indices."""
    alone = [hidden_rows(encoder, [row])[0] for row in distinct]
    batched = hidden_rows(encoder, [distinct[index] for index in batch])
    same = sum(torch.equal(got, alone[index]) for got, index in zip(batched, batch, strict=True))
    worst = max((got - alone[index]).abs().max().item() for got, index in zip(batched, batch, strict=True))
    return same, worst


def main() -> None:
    model_dir = ensure_tiny_qwen_image(DEMO_MODEL)
    demo_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir / "text_encoder", torch_dtype=torch.float32
    ).eval()
    tokenizer = load_tokenizer(model_dir)
    demo_rows = [prompt_token_ids(tokenizer, text) for text in [*DEFAULT_PROMPTS[:8], NEGATIVE_PROMPT]]
    generator = torch.Generator().manual_seed(0)
    lengths = (9, 14, 20, 17, 6, 11, 23, 15, 12)  # 8 prompts and a negative prompt, like the demo's
    test_rows = [torch.randint(1, 1000, (n,), generator=generator).tolist() for n in lengths]
    encoders = {
        "demo model (Qwen2.5-VL text, 384 x 6)": (demo_encoder, demo_rows),
        "test suite (Qwen2, 64 x 2)": (build_qwen2_encoder(), test_rows),
    }
    batches = {
        "8 prompts, one each": list(range(8)),
        "2 prompts x 4 siblings": [0, 1] * 4,
        "4 prompts x 4 siblings": [0, 1, 2, 3] * 4,
        "one prompt x 8": [0] * 8,
    }
    print(f"CPU: {cpu_summary()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| encoder | batch | rows bit-identical to rows alone | max abs difference |")
    print("|---|---|---:|---:|")
    for encoder_name, (encoder, rows) in encoders.items():
        for batch_name, batch in batches.items():
            same, worst = gap(encoder, rows, batch)
            print(f"| {encoder_name} | {batch_name} | {same}/{len(batch)} | {worst:.2g} |")


if __name__ == "__main__":
    main()
