"""The coverage matrix: what the cache does for each pipeline vLLM-Omni 0.30 ships.

``python -m vllm_omni_prompt_cache.coverage`` builds each pipeline's text stack tiny (random
weights from configs, tokenizers built locally), calls its real ``encode_prompt`` as its forward
does, and writes the table in ``docs/coverage.md``. ``harness`` holds what a case is and how it is
judged; the ``builders_*`` modules hold the cases, one module per family of pipelines.
"""
