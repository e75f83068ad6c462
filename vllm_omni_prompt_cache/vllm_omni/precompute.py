"""``vllm-omni-prompt-cache precompute``: fill the directory tier before a training run needs it.

The prompts go through the real engine as ordinary generation requests, one denoising step each
by default, so ``encode_prompt`` is called exactly as the run will call it: the same pipeline,
adapter, arguments, negative prompt and device, hence the same keys. Only the key decides a hit,
so nothing here has to guess how a pipeline calls its encoder; the price is one cheap denoising
step per prompt beside the encode.

Prompt files are JSON lines or parquet. A JSON line is what the run sends as a request's prompt: a
JSON string (a text prompt), a list of integers (``prompt_token_ids``), or an object passed as is
(``{"prompt": ...}``, ``{"prompt_token_ids": [...], "negative_prompt_ids": [...]}``...); blank lines
are skipped. With ``--prompt-column`` a line's object gives that field instead (UniRL's rows:
``{"prompt_id", "prompt", "metadata"}``). A parquet file (verl-omni's datasets) gives its
``--prompt-column`` (default ``prompt``): a string, token ids, or a chat-message list, whose last
``user`` message's text is taken; ``--negative-prompt-column`` adds each row's negative prompt.

Datasets on shared storage: ``--pack`` moves the namespace's entry files into shards read in place
(see :mod:`~vllm_omni_prompt_cache.store.tiers.directory_shards`). ``--parity-sample N`` then encodes N of the
file's stored prompts again through a second engine that audits every hit (the stored entry against
a fresh encode) and exits 1 on any difference, or on a sampled prompt the directory did not serve.

Resuming: after each batch whose files were all written, the digests of its prompts are appended
to a ledger inside the model's namespace directory (so new weights start a new ledger); a later
run skips the prompts a ledger names. A file the directory's budget removed since is encoded again
at its first use. The command exits 1 when writes failed or the tier turned off on the way.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_prompt_cache.counts.stats import CacheStats
from vllm_omni_prompt_cache.settings.schema import AUDIT, DIRECTORY, DIRECTORY_BYTES, ENABLE
from vllm_omni_prompt_cache.store.tiers.directory_shards import SHARD_BYTES, PackReport, ShardError, pack
from vllm_omni_prompt_cache.vllm_omni.cli_args import positive_int, setting_type
from vllm_omni_prompt_cache.vllm_omni.engine_client import cache_stats, open_engine, worker_values
from vllm_omni_prompt_cache.vllm_omni.prompt_files import PromptFileError, prompt_digest, read_prompts

#: Sampling parameters precompute sends unless told otherwise: the cheapest request that encodes.
DEFAULT_SAMPLING = {"num_inference_steps": 1}


@dataclass(frozen=True)
class ParityReport:
    """What a parity check found: stored entries against fresh encodes of a sample of stored prompts."""

    sampled: int  # prompts sent
    audits: int  # hits encoded again and compared
    mismatches: int  # of those, entries that differed from the fresh encode
    encodes: int  # encode calls the directory could not serve (prompts that were not stored)

    @property
    def passed(self) -> bool:
        return self.sampled > 0 and self.audits > 0 and self.mismatches == 0 and self.encodes == 0

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"parity {verdict}: {self.sampled} stored prompts sent again, {self.audits} served entries compared with "
            f"a fresh encode, {self.mismatches} differed, {self.encodes} encodes the directory did not serve"
        )


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
    packed: PackReport | None = None  # what --pack did
    pack_error: str | None = None  # why --pack failed (its entry files are left as they were)
    parity: ParityReport | None = None  # what --parity-sample found

    @property
    def failed(self) -> bool:
        """Whether some prompt is not in the directory, or a stored entry differs from a fresh encode."""
        parity_failed = self.parity is not None and not self.parity.passed
        return bool(self.dir_write_errors or self.unrecorded or self.pack_error or parity_failed)

    def summary(self) -> str:
        """Return the report as the command prints it."""
        lines = [self._encoded()]
        if self.packed is not None:
            lines.append(
                f"pack: {self.packed.packed} entry files moved into {self.packed.shards_written} new shards, "
                f"{self.packed.files_removed} files removed ({self.packed.entries} entries in {self.packed.shards} "
                f"shards now, {self.packed.unindexed_removed} shards of an interrupted pack removed)"
            )
        if self.pack_error is not None:
            lines.append(f"pack FAILED: {self.pack_error}")
        if self.parity is not None:
            lines.append(self.parity.summary())
        return "\n".join(lines)

    def _encoded(self) -> str:
        return (
            f"precompute: {self.prompts} prompts, {self.skipped} already done, {self.sent} sent; "
            f"{self.encodes} encodes ({self.rows_encoded} rows), {self.dir_hits} found in the directory, "
            f"{self.dir_writes} files written, {self.dir_write_errors} write errors"
            + (f" ({self.unrecorded} prompts left out of the ledger)" if self.unrecorded else "")
            + f", in {self.seconds:.1f} s (namespace {self.namespace}, ledger {self.ledger})"
        )


def _no_group_write(path: str, flags: int) -> int:
    """Open the ledger without group or other write (a shared group's members skip, not write, prompts),
    never through a link."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o644)


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
    pack_shards: bool = False,
    shard_bytes: int = SHARD_BYTES,
    parity_sample: int = 0,
    parity_seed: int = 0,
) -> PrecomputeReport:
    """Encode ``prompts`` into the directory tier through a real ``AsyncOmni`` engine; return what it did.

    ``progress(n)`` is called once the engine is up (``n``: prompts a ledger names), then as each
    batch of ``n`` prompts finishes. ``pack_shards``: then move the namespace's entry files into shards
    of ``shard_bytes``; ``parity_sample``: then send that many of the stored prompts (drawn with
    ``parity_seed``) through a second engine that audits every hit.
    """
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    sampling = {**DEFAULT_SAMPLING, **(sampling or {})}
    params = OmniDiffusionSamplingParams(**sampling)
    started = time.perf_counter()
    async with open_engine(engine_kwargs(model, directory, directory_bytes, engine_args or {})) as engine:
        tier = await _directory_tier(engine)
        namespace = tier["namespace"]
        namespace_dir = Path(tier["root"]) / namespace
        ledger = namespace_dir / f"precompute-{prompt_digest(sampling)[:16]}.ledger"
        done = set(ledger.read_text().split()) if ledger.exists() else set()
        pending = [prompt for prompt in prompts if prompt_digest(prompt) not in done]
        if progress is not None:  # the engine is up: the bar starts now, with the prompts already done
            progress(len(prompts) - len(pending))
        before = await cache_stats(engine) or CacheStats()
        last, unrecorded = await _encode_pending(engine, pending, params, batch_size, ledger, done, progress, before)
        added = last.since(before)
    stored = [prompt for prompt in prompts if prompt_digest(prompt) in done]  # the ledger names them
    packed = pack_error = None
    if pack_shards:
        packed, pack_error = _pack_namespace(namespace_dir, namespace, shard_bytes)
    parity = None
    if parity_sample:
        chosen = random.Random(parity_seed).sample(stored, min(parity_sample, len(stored)))
        kwargs = {**engine_kwargs(model, directory, directory_bytes, engine_args or {}), AUDIT.name: 1.0}
        parity = await _parity(kwargs, chosen, params, batch_size)
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
        packed=packed,
        pack_error=pack_error,
        parity=parity,
    )


async def _directory_tier(engine: Any) -> dict[str, Any]:
    """Return the diffusion worker's directory tier (its root and namespace); raise if the tier is not in use."""
    tiers = [tier for tier in await worker_values(engine, "get_prompt_embed_cache_namespace") if tier]
    if not tiers or tiers[0]["namespace"] is None:
        why = (
            tiers[0]["off_reason"]
            if tiers
            else "the engine's diffusion stage has none (its cache is off or vLLM-Omni's own, or the stage "
            "runs on several ranks: the worker's log says which)"
        )
        raise RuntimeError(f"precompute: the directory tier is not in use: {why}")
    return tiers[0]


async def _encode_pending(
    engine: Any,
    pending: Sequence[Any],
    params: Any,
    batch_size: int,
    ledger: Path,
    done: set[str],
    progress: Callable[[int], None] | None,
    stats_before: CacheStats,
) -> tuple[CacheStats, int]:
    """Send ``pending`` in batches, recording in ``ledger`` and ``done`` each batch whose files were all written.

    Return the cache's counters after the last batch and how many prompts were left out of the ledger.
    """
    last = stats_before
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
            done.update(prompt_digest(prompt) for prompt in batch)
        else:  # some of its files may be missing: a later run sends the batch again
            unrecorded += len(batch)
        last = now
        if progress is not None:
            progress(len(batch))
    return last, unrecorded


def _pack_namespace(namespace_dir: Path, namespace: str, shard_bytes: int) -> tuple[PackReport | None, str | None]:
    """Pack the namespace's entry files into shards; return what was packed, or why the pack failed."""
    try:
        return pack(namespace_dir, namespace, shard_bytes=shard_bytes), None
    except (ShardError, OSError) as error:  # the entry files stay as they were; the report still prints
        return None, f"pack of {namespace_dir} failed: {error}"


async def _parity(kwargs: dict[str, Any], prompts: Sequence[Any], params: Any, batch_size: int) -> ParityReport:
    """Send ``prompts`` through an engine that audits every hit; return what the audits found."""
    async with open_engine(kwargs) as engine:
        before = await cache_stats(engine) or CacheStats()  # after the start-up warm-up's encode
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            await asyncio.gather(
                *(_send(engine, prompt, params, f"parity-{start + i}") for i, prompt in enumerate(batch))
            )
        after = await cache_stats(engine) or CacheStats()
    # Audits since the start: the start-up warm-up's prompt is stored too, and its hit is audited (a wrong entry
    # there turns the cache off before the sample is sent). Encodes only of the sample: the warm-up may not be stored.
    added = after.since(before)
    return ParityReport(
        sampled=len(prompts), audits=after.audits, mismatches=after.audit_mismatches, encodes=added.misses
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
        "--prompts",
        required=True,
        type=Path,
        help="a JSON-lines prompt file (one prompt a line) or a parquet dataset (a .parquet file), as described above",
    )
    parser.add_argument(
        "--prompt-column",
        type=_column_name("--prompt-column"),
        help="the field (JSON lines: of each line's object) or parquet column holding the prompt; parquet default: "
        "prompt. A chat-message list gives its last user message's text",
    )
    parser.add_argument(
        "--negative-prompt-column",
        type=_column_name("--negative-prompt-column"),
        help="the field or column holding each row's negative prompt (default: none)",
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
    parser.add_argument(
        "--pack",
        action="store_true",
        help="then move the namespace's entry files into shards read in place (many entries a file, an index): "
        "for shared filesystems; a later run packs what it added",
    )
    parser.add_argument(
        "--shard-bytes",
        type=_shard_bytes,
        default=None,
        help="most bytes a shard holds with --pack: a byte count >= 1, optionally with a unit (512MiB, 2GB); "
        "default 1GiB",
    )
    parser.add_argument(
        "--parity-sample",
        type=positive_int,
        default=None,
        help="then encode this many of the stored prompts again (drawn at random) and compare each served entry "
        "with the fresh encode; exit 1 on any difference or on a prompt the directory did not serve",
    )
    parser.add_argument(
        "--parity-seed",
        type=_seed,
        default=None,
        help="the random draw of --parity-sample (an integer >= 0; default 0)",
    )


def _shard_bytes(text: str) -> int:
    import argparse

    from vllm_omni_prompt_cache.settings.schema import MAX_BYTES

    try:
        value = MAX_BYTES.parse(text, "command-line flag --shard-bytes")
    except ValueError:
        value = None
    if value is None:
        raise argparse.ArgumentTypeError(
            f"invalid --shard-bytes {text!r}: expected a byte count >= 1, optionally with a unit (512MiB, 2GB)"
        )
    return value


def _seed(text: str) -> int:
    import argparse

    if not text.strip().isdecimal():
        raise argparse.ArgumentTypeError(f"invalid --parity-seed {text!r}: expected an integer >= 0")
    return int(text)


def _column_name(flag: str) -> Callable[[str], str]:
    import argparse

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"invalid {flag} {text!r}: expected a field or column name")
        return text.strip()

    return parse


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

    for flag, value, needs, given in (
        ("--shard-bytes", args.shard_bytes, "--pack", args.pack),
        ("--parity-seed", args.parity_seed, "--parity-sample", args.parity_sample is not None),
    ):
        if value is not None and not given:  # a flag that would change nothing is not silently ignored
            print(f"precompute: {flag} applies with {needs} only", file=sys.stderr)
            return 2
    try:
        prompts = read_prompts(
            args.prompts, prompt_column=args.prompt_column, negative_prompt_column=args.negative_prompt_column
        )
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
                pack_shards=args.pack,
                shard_bytes=args.shard_bytes or SHARD_BYTES,
                parity_sample=args.parity_sample or 0,
                parity_seed=args.parity_seed or 0,
            )
        )
    except ShardError as error:
        print(f"precompute: {error}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    print(report.summary())
    return 1 if report.failed else 0  # some prompts are not in the directory, or a stored entry differs
