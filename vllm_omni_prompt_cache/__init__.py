"""Content-keyed prompt-embedding cache for vLLM-Omni diffusion pipelines.

The public API matches upstream ``vllm_omni.diffusion.cache.prompt_embed_cache``
(``install_prompt_embed_cache``, ``uninstall_prompt_embed_cache``,
``PromptEmbedCache``, ``resolve_prompt_embed_cache_config``); the key builder
hashes tensor arguments by content, so token-ID calls hit. The core needs only
torch, numpy and xxhash; ``vllm_omni_prompt_cache.vllm_omni`` hooks it into
stock vLLM-Omni.
"""

from vllm_omni_prompt_cache.config import (
    PromptEmbedCacheConfigError,
    PromptEmbedCacheSettings,
    resolve_prompt_embed_cache_config,
    resolve_prompt_embed_cache_settings,
)
from vllm_omni_prompt_cache.keys import Bypass, CallKey, CallKeyBuilder
from vllm_omni_prompt_cache.rows import RowLayout, RowOutput
from vllm_omni_prompt_cache.store import MISS, CacheStats, PromptEmbedCache
from vllm_omni_prompt_cache.wrapper import install_prompt_embed_cache, uninstall_prompt_embed_cache

__version__ = "0.1.0"

__all__ = [
    "MISS",
    "Bypass",
    "CacheStats",
    "CallKey",
    "CallKeyBuilder",
    "PromptEmbedCache",
    "PromptEmbedCacheConfigError",
    "PromptEmbedCacheSettings",
    "RowLayout",
    "RowOutput",
    "install_prompt_embed_cache",
    "resolve_prompt_embed_cache_config",
    "resolve_prompt_embed_cache_settings",
    "uninstall_prompt_embed_cache",
]
