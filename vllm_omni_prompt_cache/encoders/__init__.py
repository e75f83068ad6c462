"""The text encoders: which of a pipeline's modules they are (``text_encoders``), their calls intercepted and what
of their own state shapes their outputs (``intercepted``), what an entry keeps of an output and what a hit hands
back (``outputs``), what produced their embeddings (``fingerprint``: code, configuration, weights, tokenizers), and
where they live between calls (``residency``: placements, offload moves, and what a hit saved).

May import ``rows``, ``counts``, ``keys`` and the base modules.
"""
