"""An opt-in CPU platform for vLLM-Omni's diffusion engine (tests, demos, machines without a GPU).

A product of its own, beside the cache: ``VLLM_OMNI_PROMPT_CACHE_CPU_PLATFORM=1`` turns it on.
:mod:`.entry_points` answers vLLM's and vLLM-Omni's platform questions and imports nothing
from them; :mod:`.platform` and :mod:`.attention` are imported only once the opt-in is set.
"""
