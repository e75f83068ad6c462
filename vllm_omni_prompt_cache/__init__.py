"""Content-keyed prompt-embedding cache for vLLM-Omni diffusion pipelines.

The public API matches upstream ``vllm_omni.diffusion.cache.prompt_embed_cache``
(``install_prompt_embed_cache``, ``uninstall_prompt_embed_cache``,
``PromptEmbedCache``, ``resolve_prompt_embed_cache_config``); the key builder
hashes tensor arguments by content, so token-ID calls hit. The core needs only
torch, numpy and xxhash; ``vllm_omni_prompt_cache.vllm_omni`` hooks it into
stock vLLM-Omni.
"""

from vllm_omni_prompt_cache.calls.wrapper import install_prompt_embed_cache, uninstall_prompt_embed_cache
from vllm_omni_prompt_cache.keys.call_key import Bypass, CallKey, CallKeyBuilder
from vllm_omni_prompt_cache.settings.resolved import (
    PromptEmbedCacheSettings,
    resolve_prompt_embed_cache_config,
    resolve_prompt_embed_cache_settings,
)
from vllm_omni_prompt_cache.settings.schema import PromptEmbedCacheConfigError
from vllm_omni_prompt_cache.store.prompt_embed_cache import MISS, CacheStats, PromptEmbedCache

__version__ = "0.3.0"

__all__ = [
    "MISS",
    "Bypass",
    "CacheStats",
    "CallKey",
    "CallKeyBuilder",
    "PromptEmbedCache",
    "PromptEmbedCacheConfigError",
    "PromptEmbedCacheSettings",
    "install_prompt_embed_cache",
    "resolve_prompt_embed_cache_config",
    "resolve_prompt_embed_cache_settings",
    "uninstall_prompt_embed_cache",
]
