"""``vllm-omni-prompt-cache demo``: the rollout side by side in three cache modes, on this machine."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from vllm_omni_prompt_cache.demo import machine, report
from vllm_omni_prompt_cache.demo.replicas import LB_POLICIES
from vllm_omni_prompt_cache.demo.rollout import ARRIVALS, DEFAULT_PROMPTS, MODELS, MODES, RolloutResult, RolloutSpec
from vllm_omni_prompt_cache.settings.schema import MAX_BYTES, MAX_SIZE
from vllm_omni_prompt_cache.tiny.qwen_image import TinyQwenImageSpec
from vllm_omni_prompt_cache.vllm_omni.cli_args import positive_int, setting_type

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


def _subset_of(allowed: tuple[str, ...], noun: str, nouns: str) -> Callable[[str], tuple[str, ...]]:
    """Return an argparse ``type`` for a comma-separated subset of ``allowed``, without repeats."""

    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(part.strip() for part in text.split(",") if part.strip())
        expected = f"expected a comma-separated subset of {','.join(allowed)}"
        if not chosen:
            raise argparse.ArgumentTypeError(f"no {noun} in {text!r}: {expected}")
        unknown = [item for item in chosen if item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {nouns} {unknown}: {expected}")
        if len(set(chosen)) != len(chosen):
            raise argparse.ArgumentTypeError(f"{noun} listed twice in {text!r}")
        return chosen

    return parse


_modes = _subset_of(MODES, "mode", "mode(s)")
_lb_policies = _subset_of(LB_POLICIES, "policy", "policy(ies)")


def _max_num_seqs(text: str) -> tuple[int, ...]:
    values = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers >= 1 (e.g. 1,4,8,16), got {part.strip()!r} in {text!r}"
            )
        values.append(value)
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"value listed twice in {text!r}")
    return tuple(values)


def _model(text: str) -> str | Path:
    """A model name of MODELS, or the path of a saved Qwen-Image pipeline (anything with a separator or a dot)."""
    if text in MODELS:
        return text
    if "/" in text or text.startswith(".") or Path(text).is_dir():
        return Path(text)
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(MODELS)} or a model directory path, got {text!r}")


#: The size each model's pixels must be a multiple of (its VAE's downsampling times its patch size).
SIZE_MULTIPLE = {"qwen-image": 16, "wan2.2": 32, "sd3": 16}
DEFAULT_SIZE = {"qwen-image": 64, "wan2.2": 32, "sd3": 64}
LABELS = {"qwen-image": "Qwen-Image", "wan2.2": "Wan2.2", "sd3": "SD3.5"}


def model_name(args: argparse.Namespace) -> str:
    """The architecture ``--model`` names: a directory given by path is a Qwen-Image one."""
    return args.model if isinstance(args.model, str) else "qwen-image"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    _add_rollout_shape_arguments(parser)
    _add_engine_run_arguments(parser)
    _add_cache_and_model_arguments(parser)
    _add_seed_output_and_log_arguments(parser)


def _add_rollout_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options that shape the rollout's requests: prompts, siblings, arrival order, steps and size."""
    parser.add_argument(
        "--prompts",
        type=positive_int,
        default=8,
        help=f"distinct prompts P (default 8, at most {len(DEFAULT_PROMPTS)})",
    )
    parser.add_argument(
        "--group-size", type=positive_int, default=16, help="sibling requests per prompt K (default 16)"
    )
    parser.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default="interleaved",
        help="the order requests are sent in: a round of every prompt at a time (interleaved, the default), "
        "each prompt's siblings back to back (grouped, as verl lays a batch out), or shuffled",
    )
    parser.add_argument("--steps", type=positive_int, default=4, help="denoising steps per request (default 4)")
    parser.add_argument(
        "--size",
        type=positive_int,
        default=None,
        help="image or video height and width in pixels (default 64 for qwen-image and sd3, 32 for wan2.2)",
    )


def _add_engine_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options that choose the engine runs: cache modes, batch sizes, replicas and step execution."""
    parser.add_argument(
        "--modes",
        type=_modes,
        default=None,
        help="which cache modes to run, in order (default off,stock,ours, or ours with --replicas; the first "
        "is the exactness reference)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=_max_num_seqs,
        default=None,
        help="vLLM-Omni's max_num_seqs, one run of every mode per value: how many waiting requests one "
        "forward batches into one encode_prompt call (default 1,8, or 1 with --replicas)",
    )
    parser.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="replicas of the diffusion stage, each with its own cache, served by vLLM-Omni's distributed "
        "runtime in this process (default 1)",
    )
    parser.add_argument(
        "--lb-policy",
        type=_lb_policies,
        default=None,
        help="how vLLM-Omni spreads requests over the replicas, one run per policy (needs --replicas >= 2; "
        f"default with replicas: {','.join(LB_POLICIES)})",
    )
    parser.add_argument(
        "--step-execution",
        action="store_true",
        help="run vLLM-Omni's step execution (continuous batching across denoising steps; each request "
        "is encoded alone when it is admitted)",
    )


def _add_cache_and_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the cache's size limits and the model to serve."""
    parser.add_argument(
        "--cache-size",
        type=setting_type(MAX_SIZE, "--cache-size"),
        default=64,
        help="prompt_embed_cache_size for the cached modes (default 64)",
    )
    parser.add_argument(
        "--max-bytes",
        type=setting_type(MAX_BYTES, "--max-bytes"),
        default=None,
        help="prompt_embed_cache_max_bytes for our cache (e.g. 512MiB)",
    )
    parser.add_argument(
        "--model",
        type=_model,
        default="qwen-image",
        help="qwen-image (the default), wan2.2 or sd3: a small random-weight model of that architecture, built on "
        "first use and cached; or the path of a saved Qwen-Image diffusers pipeline directory",
    )


def _add_seed_output_and_log_arguments(parser: argparse.ArgumentParser) -> None:
    """Add where the results go, the first request's seed, and whether vLLM's logs show."""
    parser.add_argument("--out", type=Path, default=None, help="write report.md, results.json and time.png here")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the first request; request i uses seed + i")
    parser.add_argument("--verbose", action="store_true", help="show vLLM / vLLM-Omni logs")


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject argument combinations argparse cannot see, with a usage error; fill in defaults that depend on others."""
    replicated = args.replicas > 1
    if args.lb_policy is not None and not replicated:
        parser.error("argument --lb-policy: needs --replicas 2 or more (one replica has nothing to balance)")
    if replicated and args.lb_policy is None:
        args.lb_policy = LB_POLICIES
    if args.modes is None:
        args.modes = ("ours",) if replicated else MODES
    name = model_name(args)
    one_per_forward = name == "wan2.2"  # verl-omni's Wan2.2 adapter serves one request per forward
    if args.max_num_seqs is None:
        args.max_num_seqs = (1,) if replicated or one_per_forward else (1, 8)
    if name in ("wan2.2", "sd3") and args.step_execution:
        parser.error(f"argument --step-execution: verl-omni's {LABELS[name]} adapter has no step-execution path")
    if one_per_forward and args.max_num_seqs != (1,):
        parser.error(
            "argument --max-num-seqs: wan2.2 runs verl-omni's DanceGRPO adapter, which serves one request per "
            f"forward; got {','.join(map(str, args.max_num_seqs))}"
        )
    if args.prompts > len(DEFAULT_PROMPTS):
        parser.error(
            f"argument --prompts: at most {len(DEFAULT_PROMPTS)} distinct prompts are built in, got {args.prompts}"
        )
    if args.size is None:
        args.size = DEFAULT_SIZE[name]
    if args.size % SIZE_MULTIPLE[name]:
        parser.error(
            f"argument --size: {LABELS[name]} needs a multiple of {SIZE_MULTIPLE[name]} pixels, got {args.size}"
        )
    if isinstance(args.model, Path):
        from vllm_omni_prompt_cache.tiny.qwen_image import check_model_dir

        try:
            check_model_dir(args.model)
        except OSError as error:
            parser.error(f"argument --model: {error}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"argument --out: {str(args.out)!r} exists and is not a directory")
    missing = missing_extras(chart=args.out is not None)
    if missing:
        parser.error(
            "the demo needs "
            + " and ".join(f"{', '.join(modules)} (the {extra!r} extra)" for extra, modules in missing.items())
            + ": pip install 'vllm-omni-prompt-cache["
            + ",".join(missing)
            + "]'"
        )


#: The modules each optional extra brings that the demo imports, checked before any engine starts.
EXTRA_MODULES = {"vllm-omni": ("vllm", "vllm_omni", "diffusers", "transformers"), "demo": ("tqdm", "matplotlib")}


def missing_extras(*, chart: bool) -> dict[str, list[str]]:
    """Return, per extra, the modules the demo needs that are not installed (matplotlib only for a chart)."""
    import importlib.util

    missing: dict[str, list[str]] = {}
    for extra, modules in EXTRA_MODULES.items():
        for module in modules:
            if module == "matplotlib" and not chart:
                continue
            if importlib.util.find_spec(module) is None:
                missing.setdefault(extra, []).append(module)
    return missing


def run(args: argparse.Namespace) -> int:
    """Run the demo; return the process exit code (1 if the exactness check failed)."""
    from vllm_omni_prompt_cache.cpu_platform.entry_points import opt_in_where_no_gpu

    on_cpu = opt_in_where_no_gpu()  # before vLLM is imported
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
    """Run every mode of the rollout, print the comparison, save it if asked; return the exit code."""
    name = model_name(args)
    model_dir = _prepare_model_dir(args, name, out)
    spec = _rollout_spec(args, name, model_dir)
    requests = len(spec.requests())
    environment = environment_summary(on_cpu)  # before any engine: if it fails, nothing is lost
    print(_rollout_line(args, spec, name, requests, on_cpu), file=out)
    started = time.perf_counter()
    results = _run_every_mode(args, spec, requests, out)
    total = time.perf_counter() - started
    checks = report.check_exactness(results)
    _print_comparison(spec, results, checks, total, out)
    if args.out is not None:
        command = shlex.join(["vllm-omni-prompt-cache", *args.argv])
        paths = save_results(args.out, spec, results, checks, command, environment, out)
        print("Wrote " + ", ".join(str(path) for path in paths), file=out)
    return 0 if all(check.passed for check in checks) else 1


def _prepare_model_dir(args: argparse.Namespace, name: str, out: TextIO) -> Path:
    """Return the model directory to serve: the one given, or the demo's small model, built on first use."""
    from vllm_omni_prompt_cache.tiny.qwen_image import ensure_tiny_qwen_image

    if isinstance(args.model, Path):
        return args.model
    print(f"Preparing the demo's {name} model (built once, then cached) ...", file=out)
    if name == "wan2.2":
        from vllm_omni_prompt_cache.tiny.wan22 import ensure_tiny_wan22

        return ensure_tiny_wan22()
    if name == "sd3":
        from vllm_omni_prompt_cache.tiny.sd3 import ensure_tiny_sd3

        return ensure_tiny_sd3()
    return ensure_tiny_qwen_image(DEMO_MODEL)


def _rollout_spec(args: argparse.Namespace, name: str, model_dir: Path) -> RolloutSpec:
    """Return the rollout the arguments describe, before the per-run max_num_seqs and policy."""
    return RolloutSpec(
        model_dir=model_dir,
        prompts=DEFAULT_PROMPTS[: args.prompts],
        group_size=args.group_size,
        height=args.size,
        width=args.size,
        steps=args.steps,
        base_seed=args.seed,
        step_execution=args.step_execution,
        replicas=args.replicas,
        arrival=args.arrival,
        model=name,
    )


def _rollout_line(args: argparse.Namespace, spec: RolloutSpec, name: str, requests: int, on_cpu: bool) -> str:
    """Return the line that says, before any engine starts, what the demo is about to run."""
    policies = ", ".join(args.lb_policy or ())
    return (
        f"Rollout: {args.prompts} prompts x {args.group_size} siblings = {requests} requests per mode, "
        f"{name}, {args.steps} steps at {args.size}x{args.size}"
        f"{f' x {spec.frames} frames' if name == 'wan2.2' else ''}, CFG with a shared negative prompt, "
        f"sent {args.arrival}; "
        f"modes: {', '.join(args.modes)}; max_num_seqs: {', '.join(map(str, args.max_num_seqs))}"
        f"{'; step execution' if args.step_execution else ''}"
        f"{f'; {args.replicas} replicas, lb policies: {policies}' if args.lb_policy else ''}"
        f"; device: {'CPU' if on_cpu else 'accelerator'}."
    )


def _run_every_mode(args: argparse.Namespace, spec: RolloutSpec, requests: int, out: TextIO) -> list[RolloutResult]:
    """Run the rollout once per max_num_seqs, mode and policy, in that nesting; return the results in order."""
    runs = [
        (max_num_seqs, mode, policy)
        for max_num_seqs in args.max_num_seqs
        for mode in args.modes
        for policy in args.lb_policy or (None,)
    ]
    return [_run_one_mode(args, spec, requests, max_num_seqs, mode, policy, out) for max_num_seqs, mode, policy in runs]


def _run_one_mode(
    args: argparse.Namespace,
    spec: RolloutSpec,
    requests: int,
    max_num_seqs: int,
    mode: str,
    policy: str | None,
    out: TextIO,
) -> RolloutResult:
    """Start an engine for one (max_num_seqs, mode, policy) run and send it the rollout, with a progress bar."""
    from vllm_omni_prompt_cache.demo.rollout import run_mode

    engine_label = report.MODE_LABELS[mode] + (f", {args.replicas} replicas, {policy}" if policy else "")
    print(f"Starting an engine for {engine_label}, max_num_seqs {max_num_seqs} ...", file=out)
    progress = ModeProgress(
        f"{report.MODE_LABELS[mode]}{f' {policy}' if policy else ''} @ {max_num_seqs}", requests, out
    )
    try:
        return asyncio.run(
            run_mode(
                dataclasses.replace(spec, max_num_seqs=max_num_seqs, lb_policy=policy),
                mode,
                cache_size=args.cache_size,
                max_bytes=args.max_bytes,
                on_started=progress.start,
                on_done=progress.advance,
            )
        )
    finally:
        progress.close()


def _print_comparison(
    spec: RolloutSpec, results: list[RolloutResult], checks: list[report.Exactness], total: float, out: TextIO
) -> None:
    """Print the table of runs, the replica, encoder-share, bypass and exactness lines, and the total time."""
    print(file=out)
    print(report.render_table(report.table_rows(results)), file=out)
    print(file=out)
    for line in report.replica_lines(spec, results):
        print(line, file=out)
    share = report.encoder_share_line(results)
    if share is not None:
        print(share, file=out)
    for line in report.bypass_lines(results):
        print(f"Bypasses, {line}", file=out)
    for line in report.exactness_lines(checks):
        print(line, file=out)
    print(f"Demo finished in {total:.0f} s (engine start-ups included).", file=out)


def save_results(
    out_dir: Path,
    spec: RolloutSpec,
    results: list[RolloutResult],
    checks: list[report.Exactness],
    command: str,
    environment: dict[str, str],
    out: TextIO,
) -> list[Path]:
    """Write results.json and report.md, then the chart; return what was written.

    The numbers are on disk first: a failing chart costs only the chart, and says why.
    """
    paths = report.write_report(out_dir, spec, results, checks, command, environment)
    chart = out_dir / "time.png"
    try:
        report.write_chart(results, chart)
    except Exception as error:
        print(f"Could not draw {chart}: {type(error).__name__}: {error}", file=out)
    else:
        paths.append(chart)
    return paths


class ModeProgress:
    """One progress bar per mode, opened once that mode's engine is up: its rate counts requests, not start-up."""

    def __init__(self, label: str, total: int, out: TextIO) -> None:
        self.label, self.total, self.out = label, total, out
        self.bar = None

    def start(self) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, unit="req", desc=f"{self.label:>27}", file=self.out)

    def advance(self) -> None:
        if self.bar is None:
            return
        self.bar.update()
        if self.bar.n == self.total:
            self.close()  # now, so the final rate is the rollout's, not the engine shutdown's

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def environment_summary(on_cpu: bool) -> dict[str, str]:
    """Return the facts a reader needs to compare numbers across machines."""
    from importlib.metadata import version

    import torch

    device = torch.cuda.get_device_name(0) if not on_cpu and torch.cuda.is_available() else "CPU"
    return {
        "device": f"{device} ({os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads)",
        "cpu": machine.cpu_summary(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": version("vllm"),
        "vllm-omni": version("vllm-omni"),
    }
