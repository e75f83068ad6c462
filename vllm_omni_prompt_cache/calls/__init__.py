"""How calls are intercepted and served: a text encoder's calls, whole (``encoder_calls``) or row by row
(``row_calls``); a wrapped encode method's calls, run for real and counted, or cached whole where no text encoder is
recognised (``method_calls``); install on a pipeline (``wrapper``, ``installation``); which methods are wrapped
(``methods``); and which replica a request goes to (``routing``).

The top of the core: may import every core subpackage; ``vllm_omni/`` and the rigs import it.
"""
