"""The prompt-embed cache's serve flags: ``vllm serve MODEL --omni`` and ``vllm-omni serve MODEL --omni``.

vLLM-Omni 0.30's serve parser has no prompt-embed cache flags. We add a titled group to it;
parsed values become ``AsyncOmni`` keyword arguments exactly like the kwargs a Python caller
passes (the serve command forwards explicitly given flags as kwargs). Values are validated by
argparse, so ``--prompt-embed-cache-size 0`` is a usage error naming the flag. The parser's
``--omni-lb-policy`` and the command's check of it also learn ``prompt-affinity`` (see :mod:`.balancer`).
"""

from __future__ import annotations

import argparse
import functools
from types import ModuleType
from typing import Any

from vllm_omni_prompt_cache.calls.routing import DEFAULT_EPSILON, EPSILON_ENV, epsilon_from_env
from vllm_omni_prompt_cache.settings.schema import MAX_BYTES, Setting, carried_settings
from vllm_omni_prompt_cache.vllm_omni.imports import replace_once

#: The load-balancing policy we add (implemented in :mod:`.balancer`).
POLICY = "prompt-affinity"
POLICY_HELP = (
    f"{POLICY} (vllm-omni-prompt-cache): a prompt's requests go to one replica, whose prompt-embed cache "
    f"then encodes it once; no request is placed on a replica beyond ceil((1 + epsilon) * mean in-flight "
    f"load), epsilon from {EPSILON_ENV} (default {DEFAULT_EPSILON})."
)

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


def add_prompt_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a flag for every carried setting (see :data:`~...config.SETTINGS`) to ``parser`` under one titled
    group; a second call does nothing."""
    if MAX_BYTES.flag in parser._option_string_actions:
        return
    group = parser.add_argument_group(GROUP_TITLE, GROUP_DESCRIPTION)
    for setting in carried_settings():
        if setting.flag in parser._option_string_actions:
            continue  # a future vLLM-Omni may define it itself
        default = f"Default: {setting.described_default}. Env: {setting.env}."
        if setting.metavar is None:  # a boolean: --x / --no-x
            group.add_argument(
                setting.flag,
                dest=setting.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,  # absent unless given: vLLM-Omni's default or the env var applies
                help=f"{setting.help} {default}".replace("%", "%%"),
            )
            continue
        group.add_argument(
            setting.flag,
            dest=setting.name,
            type=setting_type(setting),
            default=argparse.SUPPRESS,
            metavar=setting.metavar,
            help=f"{setting.help} Allowed: {setting.allowed}. {default}".replace("%", "%%"),  # argparse formats with %
        )


def add_policy_choice(parser: argparse.ArgumentParser) -> None:
    """Add our policy to the parser's ``--omni-lb-policy`` choices, if it has that flag."""
    # vLLM-Omni's tracking parser parses twice, the second time with a shadow copy of each action.
    for each in (parser, getattr(parser, "_shadow", None)):
        action = None if each is None else each._option_string_actions.get("--omni-lb-policy")
        if action is None or action.choices is None or POLICY in action.choices:
            continue
        action.choices = [*action.choices, POLICY]
        action.help = f"{action.help} {POLICY_HELP}" if action.help else POLICY_HELP


def patch_serve_command(module: ModuleType, *, with_policy: bool = True) -> None:
    """Make vLLM-Omni's serve subcommand carry our flags, and accept our load-balancing policy when
    ``with_policy`` (False where the routing hooks are missing: the policy would not be applied)."""
    replace_once(module.OmniServeCommand, "subparser_init", lambda original: _adding_our_flags(original, with_policy))
    if with_policy:
        replace_once(module.OmniServeCommand, "validate", _accepting_our_policy)


def _adding_our_flags(original: Any, with_policy: bool) -> Any:
    @functools.wraps(original)
    def subparser_init(self: Any, subparsers: Any) -> Any:
        parser = original(self, subparsers)
        add_prompt_cache_arguments(parser)
        if with_policy:
            add_policy_choice(parser)
        return parser

    return subparser_init


def _accepting_our_policy(original: Any) -> Any:
    @functools.wraps(original)
    def validate(self: Any, args: argparse.Namespace) -> Any:
        if getattr(args, "omni_lb_policy", None) != POLICY:
            return original(self, args)
        epsilon_from_env()  # a bad slack fails here, named, rather than at engine start
        args.omni_lb_policy = None  # stock checks the name against its own three policies only
        try:
            return original(self, args)
        finally:
            args.omni_lb_policy = POLICY

    return validate


def positive_int(text: str) -> int:
    """An argparse ``type`` for a count of at least 1 (the commands' sizes and counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value
