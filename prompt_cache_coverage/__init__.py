"""The coverage matrix: what the cache does for each pipeline vLLM-Omni 0.30 ships.

``python -m prompt_cache_coverage`` builds each pipeline's text stack tiny (random weights from
configs, tokenizers built locally), calls its real encode method (``encode_prompt``,
or the one its forward calls instead) as its forward does, and writes the table in
``docs/coverage.md``. ``classes`` enumerates the classes the table must list from the installed
vLLM-Omni; ``harness`` holds what a case is and how it is judged; the ``builders_*`` modules hold
the cases, one module per family of pipelines.

A developer's tool, not part of the wheel: it lives at the repository root and is run from there
(``python -m prompt_cache_coverage``, or ``python -m pytest tests/test_coverage.py``), importing the
product as ``vllm_omni_prompt_cache``.
"""
