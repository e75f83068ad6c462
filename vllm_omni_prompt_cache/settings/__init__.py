"""The one settings schema: every setting with its kwarg, serve flag, environment variable, parser and
default (``schema``), resolved from those sources into one ``PromptEmbedCacheSettings``, and the docs table
made from it.

May import ``store``, ``encoders``, ``rows``, ``counts``, ``keys`` and the base modules.
"""
