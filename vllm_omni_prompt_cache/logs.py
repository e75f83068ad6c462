"""How the cache says a thing went wrong without repeating itself on every call."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("vllm_omni_prompt_cache")

_said: set[str] = set()
_lock = threading.Lock()  # its own: callers may hold their tier's lock


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time its kind (the text before any parenthesis, where
    callers put the varying detail) is said in this process."""
    kind = message.split("(")[0]
    with _lock:
        first = kind not in _said
        _said.add(kind)
    if first:
        logger.warning("Prompt-embed cache: %s.", message)
