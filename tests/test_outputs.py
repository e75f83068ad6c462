"""What an entry keeps of a text encoder's output: what encodes read of it, and nothing a later read cannot get.

Qwen-Image asks its encoder for every layer's hidden states (``output_hidden_states=True``) and reads the last; the
output also holds the last hidden state, and for a causal language model logits over the vocabulary and a KV cache.
An entry keeps the layer read, and a hit that reads another part encodes again for it, served right.
"""

from __future__ import annotations

import copy

import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

IDS = torch.tensor([[5, 17, 29, 3, 88, 41, 7, 9]])


class LastLayer(CountsEncoderRuns, torch.nn.Module):
    """Reads one hidden layer of an encoder asked for all of them, as Qwen-Image's ``_get_qwen_prompt_embeds``."""

    def __init__(self, encoder: torch.nn.Module, layer: int = -1) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.layer = layer
        self.count_encoder_calls(encoder)

    @torch.inference_mode()
    def encode_prompt(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        out = self.text_encoder(
            input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), output_hidden_states=True
        )
        return out.hidden_states[self.layer] * 1.0


def test_an_entry_keeps_the_layer_the_encode_reads() -> None:
    encoder = build_qwen2_encoder(seed=4, num_layers=4)
    cached = LastLayer(encoder)
    cache = install_prompt_embed_cache(cached)
    first = cached.encode_prompt(IDS)
    layer_bytes = first.numel() * first.element_size()
    stats = cache.stats()
    # One layer of five (and the last hidden state, which is the same values, is not kept twice: it is not read),
    # plus the witness bytes of the ids and the mask.
    assert stats["size"] == 1 and layer_bytes <= stats["bytes"] <= layer_bytes + 2 * IDS.numel() * 8 + 64, stats
    assert torch.equal(cached.encode_prompt(IDS.clone()), first) and cached.encoder_runs == 1


def test_a_hit_that_reads_what_its_entry_lacks_encodes_again_and_is_served_right() -> None:
    encoder = build_qwen2_encoder(seed=4, num_layers=4)
    twin = LastLayer(copy.deepcopy(encoder), layer=1)
    cached = LastLayer(encoder)
    install_prompt_embed_cache(cached)
    cached.encode_prompt(IDS)  # keeps the last layer
    cached.layer = 1  # the next calls read another layer
    served = cached.encode_prompt(IDS.clone())
    assert type(served) is torch.Tensor and torch.equal(served, twin.encode_prompt(IDS))
    assert cached.encoder_runs == 2  # fetched once for the layer the entry lacked
    assert torch.equal(cached.encode_prompt(IDS.clone()), served) and cached.encoder_runs == 2  # and kept since


def test_a_layer_read_whole_by_c_code_is_fetched_too() -> None:
    """``torch.stack`` reads a tuple in place, not through Python: the layers the entry lacks fetch themselves."""
    encoder = build_qwen2_encoder(seed=4, num_layers=4)
    twin = LastLayer(copy.deepcopy(encoder))
    cached = LastLayer(encoder)
    install_prompt_embed_cache(cached)
    cached.encode_prompt(IDS)
    with torch.inference_mode():
        out = cached.text_encoder(input_ids=IDS, attention_mask=torch.ones_like(IDS), output_hidden_states=True)
        expected = twin.text_encoder(input_ids=IDS, attention_mask=torch.ones_like(IDS), output_hidden_states=True)
        assert torch.equal(torch.stack(out.hidden_states), torch.stack(expected.hidden_states))


def test_a_served_model_output_reads_by_key_and_position_as_the_real_one() -> None:
    encoder = build_qwen2_encoder(seed=4, num_layers=4)
    twin = copy.deepcopy(encoder)
    cached = LastLayer(encoder)
    install_prompt_embed_cache(cached)
    cached.encode_prompt(IDS)
    with torch.inference_mode():
        out = cached.text_encoder(input_ids=IDS, attention_mask=torch.ones_like(IDS), output_hidden_states=True)
        real = twin(input_ids=IDS, attention_mask=torch.ones_like(IDS), output_hidden_states=True)
        assert list(out.keys()) == list(real.keys())
        assert torch.equal(out["last_hidden_state"], real["last_hidden_state"]) and torch.equal(out[0], real[0])
        assert all(torch.equal(a, b) for a, b in zip(out["hidden_states"], real["hidden_states"], strict=True))
        assert len(out.to_tuple()) == len(real.to_tuple())
