"""Rows of a batched call: how a call splits into rows and its output is assembled (``layout``), and the
proof on first use that a layout matches what the function really does (``layout_proofs``).

May import ``counts``, ``keys`` and the base modules.
"""
