"""The text encoder's own state: what changes its outputs gives another key or empties the cache.

An entry is what the encoder returned for those inputs with its weights and settings then. Each test caches a prompt,
changes one thing about the encoder (its weights in place, a weight replaced, a LoRA injected, train mode, its
dtype, a config attribute its forward reads), and checks that the next call reaches the encoder and equals an
uncached twin changed the same way; and that what a caller does to a served tensor never reaches the entry.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.tiny.encoder_counters import CountsEncoderRuns
from vllm_omni_prompt_cache.tiny.text_encoder import build_qwen2_encoder

IDS = torch.tensor([[5, 17, 29, 3, 88, 41]])


class Pipeline(CountsEncoderRuns, torch.nn.Module):
    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_encoder = encoder
        self.count_encoder_calls(encoder)

    def encode_prompt(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = self.text_encoder(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids))
        hidden = out.hidden_states[-2] if out.hidden_states is not None else out.last_hidden_state
        return hidden * 1.0


def pair() -> tuple[Pipeline, Pipeline]:
    encoder = build_qwen2_encoder(seed=3)
    cached, twin = Pipeline(encoder), Pipeline(copy.deepcopy(encoder))
    install_prompt_embed_cache(cached)
    return cached, twin


def in_place(encoder: torch.nn.Module) -> None:
    with torch.no_grad():
        encoder.layers[0].mlp.down_proj.weight.mul_(1.5)


def replaced(encoder: torch.nn.Module) -> None:
    old = encoder.layers[0].mlp.down_proj.weight
    encoder.layers[0].mlp.down_proj.weight = torch.nn.Parameter(old.detach() * 0.5)


def lora(encoder: torch.nn.Module) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(5)
    config = LoraConfig(r=2, target_modules=["down_proj"], init_lora_weights=False)
    inject_adapter_in_model(config, encoder)


def train_mode(encoder: torch.nn.Module) -> None:
    encoder.config.attention_dropout = 0.0  # no dropout: what train mode changes is the key, and nothing random
    encoder.train()


def float64(encoder: torch.nn.Module) -> None:
    encoder.double()


def config_read_by_forward(encoder: torch.nn.Module) -> None:
    encoder.config.output_hidden_states = True  # its forward now returns every layer, and the encode reads one


CHANGES: dict[str, Callable[[torch.nn.Module], None]] = {
    "weights written in place": in_place,
    "a weight replaced": replaced,
    "a LoRA injected": lora,
    "train mode": train_mode,
    "dtype": float64,
    "a config attribute its forward reads": config_read_by_forward,
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_changed_encoder_is_encoded_again_and_served_right(name: str) -> None:
    cached, twin = pair()
    first = cached.encode_prompt(IDS)
    assert torch.equal(cached.encode_prompt(IDS.clone()), first) and cached.encoder_runs == 1
    CHANGES[name](cached.text_encoder)
    CHANGES[name](twin.text_encoder)
    ids = IDS
    again = cached.encode_prompt(ids.clone())
    assert cached.encoder_runs == 2, "the changed encoder was not run"
    assert torch.equal(again, twin.encode_prompt(ids.clone()))
    assert not torch.equal(again, first) or name == "train mode"  # train mode without dropout: another key only
    # And the new entry is served from then on.
    assert torch.equal(cached.encode_prompt(ids.clone()), again) and cached.encoder_runs == 2


def test_a_hit_is_handed_back_on_the_device_of_its_inputs() -> None:
    """The device is no part of the key (vLLM-Omni's offload moves the encoder every call): a hit comes back where
    the call's inputs are, as the encoder's output would. No GPU here: the meta device stands in for one, on the
    function that rebuilds a served output (meta inputs themselves cannot be keyed: they hold no bytes)."""
    from vllm_omni_prompt_cache.encoders.forms import kept, take_apart
    from vllm_omni_prompt_cache.encoders.outputs import served

    output = build_qwen2_encoder(seed=3)(input_ids=IDS, attention_mask=torch.ones_like(IDS))
    form, leaves = take_apart(output)
    entry = kept(form, leaves, None)
    here = served(entry, None, lambda index: None)
    there = served(entry, torch.device("meta"), lambda index: None)
    assert here.last_hidden_state.device.type == "cpu" and there.last_hidden_state.device.type == "meta"
    assert torch.equal(here.last_hidden_state, output.last_hidden_state)


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda served: served.add_(1.0), id="in place"),
        pytest.param(lambda served: served.data.zero_(), id=".data"),
        pytest.param(lambda served: served.numpy().__setitem__(Ellipsis, 7.0), id="a NumPy view"),
    ],
)
def test_what_a_caller_writes_into_a_served_tensor_never_reaches_the_entry(write) -> None:
    """The encoder's own output, as its caller gets it, written into: the next hit is unchanged."""
    cached, twin = pair()
    expected = twin.text_encoder(input_ids=IDS, attention_mask=torch.ones_like(IDS)).last_hidden_state.detach()
    for _ in range(3):
        with torch.no_grad():
            served = cached.text_encoder(input_ids=IDS.clone(), attention_mask=torch.ones_like(IDS)).last_hidden_state
            assert torch.equal(served, expected)
            write(served)
    assert cached.encoder_runs == 1
