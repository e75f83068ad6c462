"""Where entries live: the cache and its device-memory LRU (``prompt_embed_cache``, ``entries``,
``values``), misses in flight (``flights``), lookups through the tiers below device memory (``lookups``,
``tiers/``: host memory, a shared directory with its budget, claims, trust and shards), and the audit
that re-encodes sampled encoder calls answered from it (``audit``).

May import ``encoders``, ``rows``, ``counts``, ``keys`` and the base modules; never the calls or the settings,
which hand it what it needs.
"""
