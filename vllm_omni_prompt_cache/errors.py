"""The error every bad setting raises, below both the settings (settings/schema.py) and the key reader
(directory_trust.py), so that each can import it without importing the other."""

from __future__ import annotations


class PromptEmbedCacheConfigError(ValueError):
    """A prompt-embed-cache setting has a value that is not allowed."""
