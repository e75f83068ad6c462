"""A token-ID text pipeline around a real transformers encoder with random weights.

It calls ``encode_prompt(prompt_ids, attention_mask, ...)`` the way RL rollout
adapters do, so the core cache can be tested and benchmarked on a real encoder
without vLLM-Omni.
"""

from __future__ import annotations

import torch

from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns


def build_qwen2_encoder(
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> torch.nn.Module:
    """Return a randomly initialised transformers ``Qwen2Model`` in eval mode."""
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    return Qwen2Model(config).eval()


class TokenIdTextPipeline(CountsEncoderRuns, torch.nn.Module):
    """Just enough of a diffusion pipeline: a text encoder behind a token-ID ``encode_prompt``."""

    def __init__(self, text_encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = text_encoder
        self.count_encoder_calls(text_encoder)  # runs and rows that reached it (a cache hit reaches nothing)

    @torch.inference_mode()
    def encode_prompt(
        self,
        prompt_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        num_images_per_prompt: int = 1,
        max_sequence_length: int = 512,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(prompt_embeds, mask)`` repeated per image, as Qwen-Image's does."""
        prompt_ids = prompt_ids[:, :max_sequence_length]
        if attention_mask is None:
            attention_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
        attention_mask = attention_mask[:, :max_sequence_length]
        hidden = self.text_encoder(input_ids=prompt_ids, attention_mask=attention_mask.long()).last_hidden_state
        embeds = hidden * attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (
            embeds.repeat_interleave(num_images_per_prompt, dim=0),
            attention_mask.repeat_interleave(num_images_per_prompt, dim=0),
        )


class QwenStyleTokenPipeline(TokenIdTextPipeline):
    """Encodes token ids the way Qwen-Image token-ID adapters do: each prompt's attended hidden
    states, right-padded with zeros to the longest prompt of the batch (its padding is not kept).

    Its ``encode_prompt`` has the signature vLLM-Omni's token-ID layout recognises, so tests can use
    that layout without vLLM-Omni; ``encoder_rows`` counts rows that reached the encoder.
    """

    @torch.inference_mode()
    def encode_prompt(
        self,
        prompt_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_images_per_prompt: int = 1,
        max_sequence_length: int = 1024,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(prompt_embeds [B*n, S, D], mask [B*n, S])``, S the longest attended row."""
        mask = attention_mask.bool()
        hidden = self.text_encoder(input_ids=prompt_ids, attention_mask=mask.long()).last_hidden_state
        rows = torch.split(hidden[mask], mask.sum(dim=1).tolist())
        longest = max(row.shape[0] for row in rows)
        embeds = torch.stack([torch.cat([row, row.new_zeros(longest - row.shape[0], row.shape[1])]) for row in rows])
        lengths = torch.tensor([row.shape[0] for row in rows])
        embeds_mask = (torch.arange(longest) < lengths[:, None]).long()
        embeds, embeds_mask = embeds[:, :max_sequence_length], embeds_mask[:, :max_sequence_length]
        return (
            embeds.repeat_interleave(num_images_per_prompt, dim=0),
            embeds_mask.repeat_interleave(num_images_per_prompt, dim=0),
        )
