"""What a call's key is: the canonical, type-tagged encoding of its arguments and the digests of their
content (``call_key``), and what an encode read from its pipeline while it ran (``reads``, ``method_state``).

The bottom of the package: imports nothing of it but ``errors`` and ``logs``.
"""
