"""How encode methods are intercepted: install on a pipeline (``wrapper``, ``installation``), one method's
calls, whole or by rows (``method_calls``, ``row_batches``), which methods and row layouts a class gets
(``methods``, ``layouts``), and which replica a request goes to (``routing``).

The top of the core: may import every core subpackage; ``vllm_omni/`` and the rigs import it.
"""
