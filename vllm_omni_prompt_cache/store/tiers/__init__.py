"""The tiers below device memory: the interface every tier implements and the chain that walks them
(``tier``), host memory (``host``), and a shared directory (``directory``: its files, budget, claims,
trust in writers, and shards).
"""
