"""``vllm-omni-prompt-cache precompute``: fill the directory tier before a training run needs it.

The prompts go through the real engine as ordinary generation requests, one denoising step each
by default, so ``encode_prompt`` is called exactly as the run will call it: the same pipeline,
adapter, arguments, negative prompt and device, hence the same keys. Only the key decides a hit,
so nothing here has to guess how a pipeline calls its encoder; the price is one cheap denoising
step per prompt beside the encode.

Prompt files are JSON lines. A line is what the run sends as a request's prompt: a JSON string (a
text prompt), a list of integers (``prompt_token_ids``), or an object passed as is (``{"prompt":
...}``, ``{"prompt_token_ids": [...], "negative_prompt_ids": [...]}``...). Blank lines are skipped.

Resuming: after each batch whose files were all written, the digests of its prompts are appended
to a ledger inside the model's namespace directory (so new weights start a new ledger); a later
run skips the prompts a ledger names. A file the directory's budget removed since is encoded again
at its first use. The command exits 1 when writes failed or the tier turned off on the way.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from vllm_omni_prompt_cache.config import DIRECTORY, DIRECTORY_BYTES, ENABLE
from vllm_omni_prompt_cache.stats import CacheStats
from vllm_omni_prompt_cache.vllm_omni.cli_args import positive_int, setting_type
from vllm_omni_prompt_cache.vllm_omni.engine_client import cache_stats, open_engine, worker_values

#: Sampling parameters precompute sends unless told otherwise: the cheapest request that encodes.
DEFAULT_SAMPLING = {"num_inference_steps": 1}


class PromptFileError(ValueError):
    """A prompt file line that is not a prompt."""


@dataclass(frozen=True)
class PrecomputeReport:
    """What one precompute run did."""

    prompts: int  # distinct prompts in the file
    skipped: int  # named by a ledger of an earlier run
    sent: int  # requests sent
    encodes: int  # encode_prompt calls that ran the text encoder (misses)
    rows_encoded: int  # prompt rows those encodes ran, for pipelines with a row layout
    dir_hits: int  # rows already in the directory (another process wrote them)
    dir_writes: int
    dir_write_errors: int
    seconds: float
    namespace: str
    ledger: Path
    unrecorded: int = 0  # prompts of batches with failed writes: not in the ledger, sent again next time

    def summary(self) -> str:
        """Return the report as the command prints it."""
        return (
            f"precompute: {self.prompts} prompts, {self.skipped} already done, {self.sent} sent; "
            f"{self.encodes} encodes ({self.rows_encoded} rows), {self.dir_hits} found in the directory, "
            f"{self.dir_writes} files written, {self.dir_write_errors} write errors"
            + (f" ({self.unrecorded} prompts left out of the ledger)" if self.unrecorded else "")
            + f", in {self.seconds:.1f} s (namespace {self.namespace}, ledger {self.ledger})"
        )


def read_prompts(path: str | Path) -> list[Any]:
    """Return the file's prompts in order, each once; raise :class:`PromptFileError` naming a bad line."""
    prompts: list[Any] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise PromptFileError(f"{path}:{number}: not JSON ({error.msg})") from None
            prompt = _as_prompt(value)
            if prompt is None:
                raise PromptFileError(
                    f"{path}:{number}: expected a JSON string (a text prompt), a list of integers (token ids) "
                    f'or an object (a request prompt, e.g. {{"prompt_token_ids": [...]}}), got {line.strip()[:60]!r}'
                )
            digest = prompt_digest(prompt)
            if digest not in seen:
                seen.add(digest)
                prompts.append(prompt)
    return prompts


def _as_prompt(value: Any) -> Any:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(type(item) is int for item in value):
        return {"prompt_token_ids": value}
    if isinstance(value, dict) and value:
        return value
    return None


def _no_group_write(path: str, flags: int) -> int:
    """Open the ledger without group or other write (a shared group's members skip, not write, prompts),
    never through a link."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o644)


def prompt_digest(prompt: Any) -> str:
    """Return a stable digest of one prompt (what a ledger records)."""
    return xxhash.xxh3_128_hexdigest(json.dumps(prompt, sort_keys=True).encode())


def engine_kwargs(
    model: str, directory: str, directory_bytes: int | None, engine_args: dict[str, Any]
) -> dict[str, Any]:
    """Return the ``AsyncOmni`` kwargs: the user's, with the cache and its directory tier on
    (``directory_bytes`` None: no limit)."""
    budget = "none" if directory_bytes is None else directory_bytes  # None would read as "not given"
    return {"model": model, **engine_args, ENABLE.name: True, DIRECTORY.name: directory, DIRECTORY_BYTES.name: budget}


async def precompute(
    model: str,
    prompts: Sequence[Any],
    directory: str,
    *,
    directory_bytes: int | None = DIRECTORY_BYTES.default,
    batch_size: int = 8,
    sampling: dict[str, Any] | None = None,
    engine_args: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> PrecomputeReport:
    """Encode ``prompts`` into the directory tier through a real ``AsyncOmni`` engine; return what it did.

    ``progress(n)`` is called once the engine is up (``n``: prompts a ledger names), then as each
    batch of ``n`` prompts finishes.
    """
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    sampling = {**DEFAULT_SAMPLING, **(sampling or {})}
    params = OmniDiffusionSamplingParams(**sampling)
    started = time.perf_counter()
    async with open_engine(engine_kwargs(model, directory, directory_bytes, engine_args or {})) as engine:
        tiers = [tier for tier in await worker_values(engine, "get_prompt_embed_cache_namespace") if tier]
        if not tiers or tiers[0]["namespace"] is None:
            why = (
                tiers[0]["off_reason"]
                if tiers
                else "the engine's diffusion stage has none (its cache is off or vLLM-Omni's own, or the stage "
                "runs on several ranks: the worker's log says which)"
            )
            raise RuntimeError(f"precompute: the directory tier is not in use: {why}")
        namespace = tiers[0]["namespace"]
        ledger = Path(tiers[0]["root"]) / namespace / f"precompute-{prompt_digest(sampling)[:16]}.ledger"
        done = set(ledger.read_text().split()) if ledger.exists() else set()
        pending = [prompt for prompt in prompts if prompt_digest(prompt) not in done]
        if progress is not None:  # the engine is up: the bar starts now, with the prompts already done
            progress(len(prompts) - len(pending))
        before = last = await cache_stats(engine) or CacheStats()
        unrecorded = 0
        for start in range(0, len(pending), batch_size):
            batch = pending[start : start + batch_size]
            await asyncio.gather(
                *(_send(engine, prompt, params, f"precompute-{start + i}") for i, prompt in enumerate(batch))
            )
            now = await cache_stats(engine) or CacheStats()
            if now.dir_write_errors == last.dir_write_errors and now.dir_off_reason is None:
                with open(ledger, "a", encoding="utf-8", opener=_no_group_write) as record:
                    record.write("".join(f"{prompt_digest(prompt)}\n" for prompt in batch))
            else:  # some of its files may be missing: a later run sends the batch again
                unrecorded += len(batch)
            last = now
            if progress is not None:
                progress(len(batch))
        added = last.since(before)
    return PrecomputeReport(
        prompts=len(prompts),
        skipped=len(prompts) - len(pending),
        sent=len(pending),
        encodes=added.misses,
        rows_encoded=added.rows_encoded,
        dir_hits=added.dir_hits,
        dir_writes=added.dir_writes,
        dir_write_errors=added.dir_write_errors,
        seconds=time.perf_counter() - started,
        namespace=namespace,
        ledger=ledger,
        unrecorded=unrecorded,
    )


async def _send(engine: Any, prompt: Any, params: Any, request_id: str) -> None:
    final = None
    async for output in engine.generate(prompt, params, request_id=request_id):
        final = output
    if final is None or final.error:
        raise RuntimeError(f"precompute: request {request_id} failed: {None if final is None else final.error}")


def add_arguments(parser: Any) -> None:
    """Add the subcommand's flags."""
    parser.add_argument("--model", required=True, help="the model directory or id the run serves")
    parser.add_argument(
        "--prompts", required=True, type=Path, help="a JSON-lines prompt file (one prompt a line, as described above)"
    )
    parser.add_argument(
        "--cache-dir",
        required=True,
        type=setting_type(DIRECTORY, "--cache-dir"),
        help=f"the directory tier ({DIRECTORY.name})",
    )
    parser.add_argument(
        "--cache-dir-bytes",
        type=setting_type(DIRECTORY_BYTES, "--cache-dir-bytes"),
        default=DIRECTORY_BYTES.default,
        help=f"its byte budget ({DIRECTORY_BYTES.name}): {DIRECTORY_BYTES.allowed}; default 16GiB",
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, help="requests in flight at once (default 8)")
    parser.add_argument(
        "--sampling-params",
        type=_json_object("--sampling-params"),
        default={},
        help="JSON object of OmniDiffusionSamplingParams the run uses where they decide encode_prompt's calls "
        "(true_cfg_scale / guidance_scale turn the negative prompt's encode on); "
        f"default {json.dumps(DEFAULT_SAMPLING)}",
    )
    parser.add_argument(
        "--engine-args",
        type=_json_object("--engine-args"),
        default={},
        help='JSON object of the AsyncOmni keyword arguments the run uses (e.g. {"custom_pipeline_args": ...})',
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _json_object(flag: str) -> Callable[[str], dict[str, Any]]:
    import argparse

    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"invalid {flag} {text!r}: not JSON ({error.msg})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"invalid {flag} {text!r}: expected a JSON object")
        return value

    return parse


def run(args: Any) -> int:
    """Run the subcommand; return its exit code."""
    import sys

    try:
        prompts = read_prompts(args.prompts)
    except (OSError, PromptFileError) as error:
        print(f"precompute: {error}", file=sys.stderr)
        return 2
    bar = None

    def advance(count: int) -> None:  # the bar is made on the first call: engine start-up is not a prompt's
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), unit="prompt", desc="precompute")
        bar.update(count)

    try:
        report = asyncio.run(
            precompute(
                args.model,
                prompts,
                args.cache_dir,
                directory_bytes=args.cache_dir_bytes,
                batch_size=args.batch_size,
                sampling=args.sampling_params,
                engine_args=args.engine_args,
                progress=None if args.no_progress else advance,
            )
        )
    finally:
        if bar is not None:
            bar.close()
    print(report.summary())
    return 1 if report.dir_write_errors or report.unrecorded else 0  # some prompts are not in the directory
