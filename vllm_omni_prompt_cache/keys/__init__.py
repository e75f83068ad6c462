"""What a key is: the canonical, type-tagged encoding of values and the digests of their content, with the
witness bytes a hit is verified against (``call_key``).

The bottom of the package: imports nothing of it but ``errors`` and ``logs``.
"""
