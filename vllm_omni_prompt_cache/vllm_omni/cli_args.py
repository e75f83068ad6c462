"""The prompt-embed cache's serve flags: ``vllm serve MODEL --omni`` and ``vllm-omni serve MODEL --omni``.

vLLM-Omni 0.30's serve parser has no prompt-embed cache flags. We add a titled group to it;
parsed values become ``AsyncOmni`` keyword arguments exactly like the kwargs a Python caller
passes (the serve command forwards explicitly given flags as kwargs). Values are validated by
argparse, so ``--prompt-embed-cache-size 0`` is a usage error naming the flag.
"""

from __future__ import annotations

import argparse
import functools
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.config import BACKEND, BACKENDS, ENABLE, MAX_BYTES, MAX_SIZE, VERIFY, Setting
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

# Named like vLLM's own groups, so `vllm serve --help=PromptEmbedCacheConfig` shows the section.
GROUP_TITLE = "PromptEmbedCacheConfig"
GROUP_DESCRIPTION = (
    "Content-keyed cache of the diffusion pipeline's encode_prompt outputs (vllm-omni-prompt-cache); "
    "token-ID tensors hit. Each flag has an environment variable that overrides it."
)


def setting_type(setting: Setting, flag: str | None = None) -> Any:
    """Return an argparse ``type`` that parses ``setting``; its errors name ``flag`` (the setting's own by default)."""
    source = f"command-line flag {flag or setting.flag}"

    def parse(text: str) -> Any:
        try:
            return setting.parse(text, source)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = setting.name  # argparse names the type in some messages
    return parse


def _describe_default(setting: Setting) -> str:
    if setting.default is None:
        return "no limit"
    if isinstance(setting.default, bool):
        return "on" if setting.default else "off"
    return str(setting.default)


def add_prompt_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the cache flags to ``parser`` under one titled group; a second call does nothing."""
    if MAX_BYTES.flag in parser._option_string_actions:
        return
    group = parser.add_argument_group(GROUP_TITLE, GROUP_DESCRIPTION)
    for setting in (ENABLE, VERIFY):
        if setting.flag in parser._option_string_actions:
            continue  # a future vLLM-Omni may define it itself
        group.add_argument(
            setting.flag,
            dest=setting.name,
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,  # absent unless given: vLLM-Omni's default or the env var applies
            help=f"{setting.help} Default: {_describe_default(setting)}. Env: {setting.env}.",
        )
    for setting, metavar in ((MAX_SIZE, "N"), (MAX_BYTES, "BYTES"), (BACKEND, "{" + ",".join(BACKENDS) + "}")):
        if setting.flag in parser._option_string_actions:
            continue
        group.add_argument(
            setting.flag,
            dest=setting.name,
            type=setting_type(setting),
            default=argparse.SUPPRESS,
            metavar=metavar,
            help=f"{setting.help} Allowed: {setting.allowed}. Default: {_describe_default(setting)}. "
            f"Env: {setting.env}.",
        )


def patch_serve_command(module: ModuleType) -> None:
    """Make vLLM-Omni's serve subcommand parser carry our flags."""
    replace_once(module.OmniServeCommand, "subparser_init", _adding_our_flags)


def _adding_our_flags(original: Any) -> Any:
    @functools.wraps(original)
    def subparser_init(self: Any, subparsers: Any) -> Any:
        parser = original(self, subparsers)
        add_prompt_cache_arguments(parser)
        return parser

    return subparser_init
