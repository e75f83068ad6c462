"""How stock vLLM-Omni is hooked: plugin entry points, serve flags, worker lifecycle, CPU platform.

Importing this package imports nothing from vLLM or vLLM-Omni; each module does so itself, so the
entry points stay cheap where they do not apply.
"""
