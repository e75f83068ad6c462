"""``vllm-omni-prompt-cache demo``: the rollout side by side in three cache modes, on this machine."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import TextIO

from vllm_omni_prompt_cache.demo.rollout import DEFAULT_PROMPTS, MODES, RolloutResult, RolloutSpec
from vllm_omni_prompt_cache.tiny.qwen_image import TinyQwenImageSpec

#: The demo's default model: Qwen-Image's architecture, sized so that on 2 CPU cores the text
#: encoder takes a visible share of each request and three modes finish in about a minute.
DEMO_MODEL = TinyQwenImageSpec(
    text_hidden_size=384,
    text_layers=6,
    text_heads=6,
    text_intermediate_size=1024,
    transformer_layers=2,
    transformer_heads=2,
    transformer_head_dim=32,
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {unknown or [text]}: expected a comma-separated subset of {','.join(MODES)}"
        )
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"mode listed twice in {text!r}")
    return modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.add_argument(
        "--prompts",
        type=_positive_int,
        default=8,
        help=f"distinct prompts P (default 8, at most {len(DEFAULT_PROMPTS)})",
    )
    parser.add_argument(
        "--group-size", type=_positive_int, default=16, help="sibling requests per prompt K (default 16)"
    )
    parser.add_argument("--steps", type=_positive_int, default=4, help="denoising steps per request (default 4)")
    parser.add_argument("--size", type=_positive_int, default=64, help="image height and width in pixels (default 64)")
    parser.add_argument(
        "--modes",
        type=_modes,
        default=MODES,
        help="which cache modes to run, in order (default off,stock,ours; the first is the exactness reference)",
    )
    parser.add_argument(
        "--cache-size", type=_positive_int, default=64, help="prompt_embed_cache_size for the cached modes (default 64)"
    )
    parser.add_argument("--max-bytes", default=None, help="prompt_embed_cache_max_bytes for our cache (e.g. 512MiB)")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a saved Qwen-Image diffusers pipeline directory (default: a small one built on first use and cached)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write report.md, results.json and time.png here")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the first request; request i uses seed + i")
    parser.add_argument("--verbose", action="store_true", help="show vLLM / vLLM-Omni logs")


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject argument combinations argparse cannot see, with a usage error."""
    if args.prompts > len(DEFAULT_PROMPTS):
        parser.error(
            f"argument --prompts: at most {len(DEFAULT_PROMPTS)} distinct prompts are built in, got {args.prompts}"
        )
    if args.size % 16:
        parser.error(f"argument --size: Qwen-Image needs a multiple of 16 pixels, got {args.size}")
    if args.max_bytes is not None:
        from vllm_omni_prompt_cache.config import MAX_BYTES, parse_setting

        try:
            args.max_bytes = parse_setting(MAX_BYTES, args.max_bytes, "command-line flag --max-bytes")
        except ValueError as error:
            parser.error(f"argument --max-bytes: {error}")
    if args.model is not None:
        from vllm_omni_prompt_cache.tiny.qwen_image import check_model_dir

        try:
            check_model_dir(args.model)
        except OSError as error:
            parser.error(f"argument --model: {error}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"argument --out: {str(args.out)!r} exists and is not a directory")


def run(args: argparse.Namespace) -> int:
    """Run the demo; return the process exit code (1 if the exactness check failed)."""
    from vllm_omni_prompt_cache.demo.rollout import use_cpu_platform_if_no_gpu

    on_cpu = use_cpu_platform_if_no_gpu()  # before vLLM is imported
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # An in-process diffusion worker prefixes everything written to sys.stdout with its name;
    # the demo's own output goes to a separate handle on the same terminal.
    out = open(os.dup(sys.stdout.fileno()), "w", buffering=1)  # noqa: SIM115 (closed below)
    try:
        return _run(args, out, on_cpu)
    finally:
        out.close()


def _run(args: argparse.Namespace, out: TextIO, on_cpu: bool) -> int:
    from tqdm import tqdm

    from vllm_omni_prompt_cache.demo import report
    from vllm_omni_prompt_cache.demo.rollout import run_mode
    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image

    if args.model is None:
        print("Preparing the demo model (built once, then cached) ...", file=out)
        model_dir = ensure_tiny_qwen_image(DEMO_MODEL)
    else:
        model_dir = args.model
    spec = RolloutSpec(
        model_dir=model_dir,
        prompts=DEFAULT_PROMPTS[: args.prompts],
        group_size=args.group_size,
        height=args.size,
        width=args.size,
        steps=args.steps,
        base_seed=args.seed,
    )
    requests = len(spec.requests())
    print(
        f"Rollout: {args.prompts} prompts x {args.group_size} siblings = {requests} requests per mode, "
        f"{args.steps} steps at {args.size}x{args.size}, CFG with a shared negative prompt; "
        f"modes: {', '.join(args.modes)}; device: {'CPU' if on_cpu else 'accelerator'}.",
        file=out,
    )
    results: list[RolloutResult] = []
    started = time.perf_counter()
    with tqdm(total=requests * len(args.modes), unit="req", dynamic_ncols=True, file=out) as progress:
        for mode in args.modes:
            progress.set_description(f"{report.MODE_LABELS[mode]:>22}")
            result = asyncio.run(
                run_mode(
                    spec, mode, cache_size=args.cache_size, max_bytes=args.max_bytes, on_done=lambda: progress.update()
                )
            )
            results.append(result)
    total = time.perf_counter() - started
    exactness = report.check_exactness(results)

    print(file=out)
    print(report.render_table(report.table_rows(results)), file=out)
    print(file=out)
    off = next((r for r in results if r.mode == "off"), None)
    if off is not None:
        print(f"Text encoding took {report.encoder_share(off):.0%} of the uncached rollout.", file=out)
    for line in report.bypass_lines(results):
        print(f"Bypasses, {line}", file=out)
    print(report.exactness_line(exactness), file=out)
    print(f"Demo finished in {total:.0f} s (engine start-ups included).", file=out)
    if args.out is not None:
        environment = environment_summary(on_cpu)
        command = (
            shlex.join(["vllm-omni-prompt-cache", *sys.argv[2:]])
            if len(sys.argv) > 1
            else "vllm-omni-prompt-cache demo"
        )
        paths = report.write_report(args.out, spec, results, exactness, command, environment)
        print("Wrote " + ", ".join(str(path) for path in paths), file=out)
    return 0 if exactness is None or exactness.all_identical else 1


def environment_summary(on_cpu: bool) -> dict[str, str]:
    """Return the facts a reader needs to compare numbers across machines."""
    from importlib.metadata import version

    import torch

    device = "CPU" if on_cpu else torch.cuda.get_device_name(0)
    return {
        "device": f"{device} ({os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": version("vllm"),
        "vllm-omni": version("vllm-omni"),
    }
