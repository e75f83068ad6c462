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

from vllm_omni_prompt_cache.config import ENABLE, MAX_BYTES, MAX_SIZE, VERIFY, Setting, parse_setting

GROUP_TITLE = "Prompt-embed cache (vllm-omni-prompt-cache)"
GROUP_DESCRIPTION = (
    "Cache text-encoder outputs of the diffusion pipeline's encode_prompt, keyed by argument "
    "content (token-ID tensors included). Each flag has an environment variable that overrides it."
)


def _flag_type(setting: Setting) -> Any:
    def parse(text: str) -> Any:
        try:
            return parse_setting(setting, text, f"command-line flag {setting.flag}")
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = setting.name  # argparse names the type in some messages
    return parse


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
            default=None,
            help=f"{setting.help} Env: {setting.env}.",
        )
    for setting in (MAX_SIZE, MAX_BYTES):
        if setting.flag in parser._option_string_actions:
            continue
        group.add_argument(
            setting.flag,
            dest=setting.name,
            type=_flag_type(setting),
            default=None,
            metavar="N" if setting is MAX_SIZE else "BYTES",
            help=f"{setting.help} Allowed: {setting.allowed}. Env: {setting.env}.",
        )


def patch_serve_command(module: ModuleType) -> None:
    """Make vLLM-Omni's serve subcommand parser carry our flags."""
    command_cls = module.OmniServeCommand
    original = command_cls.subparser_init
    if getattr(original, "_prompt_cache_hooked", False):
        return

    @functools.wraps(original)
    def subparser_init(self: Any, subparsers: Any) -> Any:
        parser = original(self, subparsers)
        add_prompt_cache_arguments(parser)
        return parser

    subparser_init._prompt_cache_hooked = True  # type: ignore[attr-defined]
    command_cls.subparser_init = subparser_init
