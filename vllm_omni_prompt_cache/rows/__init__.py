"""Rows of a batched text-encoder call: which inputs carry them, one row's (or a sub-batch's) inputs, and how rows
encoded apart are compared with the batch (``encoder_rows``).

May import ``counts``, ``keys`` and the base modules.
"""
