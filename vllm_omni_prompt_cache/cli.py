"""The ``vllm-omni-prompt-cache`` command."""

from __future__ import annotations

import argparse
import sys

from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu
from vllm_omni_prompt_cache.demo import command as demo_command
from vllm_omni_prompt_cache.vllm_omni import precompute as precompute_command


def build_parser() -> argparse.ArgumentParser:
    """Return the command's parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="vllm-omni-prompt-cache",
        description="Content-keyed prompt-embedding cache for vLLM-Omni.",
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = subcommands.add_parser(
        "demo",
        help="run a GRPO-shaped rollout through vLLM-Omni with no cache, the stock cache and ours",
        description="Run a GRPO-shaped rollout through vLLM-Omni's AsyncOmni with no cache, vLLM-Omni's "
        "own cache and this package's, side by side, and check that the latents are identical.",
    )
    demo_command.add_arguments(demo)
    subcommands.add_parser(
        "check",
        help="say whether engines in this environment will use the cache, and why not (imports no vLLM)",
        description="Say what the plugin will do in this environment: versions, entry points, vLLM-Omni's "
        "hook points, the plugin switch and the cache's environment variables. Exit code 0 if active, 1 if not.",
    )
    precompute = subcommands.add_parser(
        "precompute",
        help="encode a prompt file into the directory tier through the real engine, so a run's first epoch hits",
        description="Encode every prompt of a JSON-lines file through vLLM-Omni's AsyncOmni, with the cache's "
        "directory tier on, one cheap request per prompt, in batches, resumably. Lines: a JSON string (text), "
        "a list of integers (token ids) or an object (a request prompt as the run sends it).",
    )
    precompute_command.add_arguments(precompute)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; return the exit code."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = list(argv)
    if args.command == "demo":
        demo_command.validate(parser, args)
        return demo_command.run(args)
    if args.command == "precompute":
        opt_in_where_no_gpu()  # as the demo: with no GPU, vLLM-Omni runs on this package's CPU platform
        return precompute_command.run(args)
    if args.command == "check":
        from vllm_omni_prompt_cache.vllm_omni.check import check

        return check()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
