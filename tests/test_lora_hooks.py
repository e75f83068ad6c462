"""Each of the five DiffusionLoRAManager hooks, driven through vLLM-Omni's own LoRA manager on CPU.

Nothing is mocked: vLLM-Omni 0.30's ``DiffusionLoRAManager`` is built by its ``__init__`` over a
tiny pipeline of vLLM ``ReplicatedLinear`` layers, which its real code wraps in vLLM-Omni's LoRA
layers (plain torch matmuls, no punica kernels); the adapters are written by ``peft`` itself and
loaded from disk by vLLM. vLLM layers need a TP group and a vLLM config, so a single-rank gloo
group and a default ``VllmConfig`` are set up for the module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_omni_prompt_cache import install_prompt_embed_cache
from vllm_omni_prompt_cache.tiny.text_encoder import TokenIdTextPipeline

ENCODER_LAYER, TRANSFORMER_LAYER = "text_encoder.q_proj", "transformer.to_q"
LAYERS = pytest.mark.parametrize(("target", "cleared"), [(ENCODER_LAYER, True), (TRANSFORMER_LAYER, False)])
WIDTH, RANK = 16, 4
IDS = torch.tensor([[3, 1, 4, 1, 5]])


@pytest.fixture(scope="module")
def manager_cls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[type]:
    """The hooked manager class, inside the vLLM config and TP group its layers need."""
    pytest.importorskip("vllm_omni")
    from vllm_omni_prompt_cache.vllm_omni import plugin

    plugin.register()  # hooks the manager module when it is imported below
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager

    with set_current_vllm_config(VllmConfig()):
        owned = not parallel_state.model_parallel_is_initialized()
        if owned:
            store = tmp_path_factory.mktemp("gloo") / "rendezvous"
            parallel_state.init_distributed_environment(1, 0, f"file://{store}", 0, "gloo")
            parallel_state.initialize_model_parallel(1, 1)
        yield DiffusionLoRAManager
        if owned:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def vllm_linear() -> torch.nn.Module:
    """A random vLLM ReplicatedLinear, post-processed the way vLLM's loader does (picks the CPU GEMM)."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(WIDTH, WIDTH, bias=False, params_dtype=torch.float32, return_bias=False, disable_tp=True)
    torch.nn.init.normal_(layer.weight)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


class TinyEncoder(torch.nn.Module):
    """An embedding and one LoRA-able vLLM linear: the smallest text encoder a LoRA can change."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, WIDTH)
        self.q_proj = vllm_linear()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        from transformers.modeling_outputs import BaseModelOutput

        # A model output, as transformers encoders return: what an entry can keep (a SimpleNamespace is not).
        return BaseModelOutput(last_hidden_state=self.q_proj(self.embed(input_ids)))


class TinyPipeline(TokenIdTextPipeline):
    """Encoder plus transformer; ``_lora_components`` makes the manager scan the encoder too."""

    _lora_components = ("text_encoder",)

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(TinyEncoder())
        self.transformer = torch.nn.ModuleDict({"to_q": vllm_linear()})


def write_adapter(path: Path, target: str, seed: int) -> Path:
    """Have peft write a real adapter for ``target`` (random non-zero B, so it changes outputs)."""
    import peft

    torch.manual_seed(seed)
    mirror = torch.nn.ModuleDict(
        {
            name: torch.nn.ModuleDict({leaf: torch.nn.Linear(WIDTH, WIDTH, bias=False)})
            for name, leaf in (layer.split(".") for layer in (ENCODER_LAYER, TRANSFORMER_LAYER))
        }
    )
    config = peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=[target], init_lora_weights=False)
    peft.get_peft_model(mirror, config).save_pretrained(path)
    return path


@pytest.fixture
def rig(manager_cls: type, tmp_path: Path) -> SimpleNamespace:
    """A pipeline with a filled cache, a real manager over it, and a LoRARequest maker."""
    from vllm.lora.request import LoRARequest

    pipeline = TinyPipeline()
    cache = install_prompt_embed_cache(pipeline)
    manager = manager_cls(pipeline, torch.device("cpu"), torch.float32, max_cached_adapters=2)

    def request(target: str, adapter_id: int = 1) -> Any:
        path = write_adapter(tmp_path / f"adapter{adapter_id}", target, seed=adapter_id)
        return LoRARequest(lora_name=f"adapter{adapter_id}", lora_int_id=adapter_id, lora_path=str(path))

    encode: Callable[[], torch.Tensor] = lambda: pipeline.encode_prompt(IDS, IDS != 0)[0]  # noqa: E731
    base = encode()
    assert len(cache) == 1
    return SimpleNamespace(pipeline=pipeline, cache=cache, manager=manager, request=request, encode=encode, base=base)


@LAYERS
@pytest.mark.release  # the methods every release has
def test_add_adapter_clears_when_it_wraps_text_encoder_layers(rig: SimpleNamespace, target: str, cleared: bool) -> None:
    """Adding wraps layers in LoRA layers; that is a new bound state for the encoder only if wrapped there."""
    from vllm.lora.layers import BaseLayerWithLoRA

    assert rig.manager.add_adapter(rig.request(target))
    assert list(rig.manager._lora_modules) == [target]
    assert isinstance(rig.pipeline.get_submodule(target), BaseLayerWithLoRA)
    assert (len(rig.cache) == 0) is cleared
    rig.encode()
    assert rig.manager.add_adapter(rig.request(target, adapter_id=2))  # same layer, nothing active: no change
    assert len(rig.cache) == 1 and rig.manager.list_adapters() == [1, 2]


@LAYERS
@pytest.mark.release  # the methods every release has
def test_activating_clears_and_the_encoder_then_sees_the_lora(rig: SimpleNamespace, target: str, cleared: bool) -> None:
    """set_active_adapter of a registered adapter goes straight to _activate_adapter, which binds weights."""
    request = rig.request(target)
    rig.manager.add_adapter(request)
    rig.encode()
    rig.manager.set_active_adapter(request, 1.0)
    assert rig.manager._active_adapter_id == 1
    assert (len(rig.cache) == 0) is cleared
    misses = rig.cache.misses
    adapted = rig.encode()
    assert (rig.cache.misses == misses + 1) is cleared
    assert torch.allclose(adapted, rig.base) is not cleared  # a stale hit would have served the base output
    rig.manager.set_active_adapter(request, 1.0)  # already active at this scale: nothing changes
    assert len(rig.cache) == 1
    rig.manager.set_active_adapter(request, 0.5)  # a new scale rebinds the weights
    assert (len(rig.cache) == 0) is cleared


@LAYERS
def test_deactivating_clears_and_the_encoder_is_back_to_base(rig: SimpleNamespace, target: str, cleared: bool) -> None:
    """set_active_adapter(None) runs _deactivate_all_adapters, which suspends every LoRA layer."""
    request = rig.request(target)
    rig.manager.set_active_adapter(request, 1.0)
    rig.encode()
    rig.manager.set_active_adapter(None)
    assert rig.manager._active_adapter_id is None and rig.manager._suspended_adapter_id == 1
    assert (len(rig.cache) == 0) is cleared
    assert torch.allclose(rig.encode(), rig.base)  # recomputed (encoder LoRA) or a hit that is still right
    rig.manager._deactivate_all_adapters()  # already inactive: nothing changes
    assert len(rig.cache) == 1


@pytest.mark.parametrize("suspend", [True, False], ids=["suspended", "active"])
def test_removing_a_bound_adapter_clears_and_an_unbound_one_does_not(rig: SimpleNamespace, suspend: bool) -> None:
    """remove_adapter tears a bound adapter down; 0.30 does it through the hooked deactivate/reset methods."""
    bound = rig.request(ENCODER_LAYER)
    rig.manager.add_adapter(rig.request(ENCODER_LAYER, adapter_id=2))
    rig.manager.set_active_adapter(bound, 1.0)
    if suspend:
        rig.manager.set_active_adapter(None)
    rig.encode()
    assert rig.manager.remove_adapter(2)  # registered but never bound: nothing changes
    assert len(rig.cache) == 1
    assert rig.manager.remove_adapter(1)
    assert rig.manager.list_adapters() == []
    assert rig.manager._active_adapter_id is None and rig.manager._suspended_adapter_id is None
    assert len(rig.cache) == 0


@LAYERS
def test_resetting_lora_layers_clears_a_suspended_upload(rig: SimpleNamespace, target: str, cleared: bool) -> None:
    """_reset_lora_layers is called directly: in 0.30 its callers (remove, a failed bind) are hooked too."""
    rig.manager.set_active_adapter(rig.request(target), 1.0)
    rig.manager.set_active_adapter(None)
    rig.encode()
    rig.manager._reset_lora_layers()
    assert rig.manager._suspended_adapter_id is None
    assert not rig.pipeline.get_submodule(target).lora_b_stacked[0].any()  # the upload is zeroed
    assert (len(rig.cache) == 0) is cleared
    rig.encode()
    rig.manager._reset_lora_layers()  # nothing suspended any more: nothing changes
    assert len(rig.cache) == 1
