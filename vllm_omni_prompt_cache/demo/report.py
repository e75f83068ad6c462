"""What the demo shows a person: a terminal table, and a Markdown report, JSON and a PNG chart."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_omni_prompt_cache.counts.counters import HITS, MISSES
from vllm_omni_prompt_cache.demo.rollout import RolloutResult, RolloutSpec


def _stock_label() -> str:
    """vLLM-Omni's own cache, named with the installed release (the series alone where it is a final one)."""
    try:
        version = importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return "vLLM-Omni cache"
    major_minor, _, patch = version.rpartition(".")
    return f"vLLM-Omni {major_minor if patch == '0' else version} cache"


MODE_LABELS = {
    "off": "no cache",
    "stock": _stock_label(),
    "ours": "vllm-omni-prompt-cache",
}


#: Largest final-latent difference accepted where bit identity is not expected (max_num_seqs > 1).
#: Measured differences were up to 1.3e-06 (docs/benchmarks.md); a misplaced row or copy shows as
#: a difference of order 1, so this catches layout errors without judging rounding.
LATENT_TOLERANCE = 1e-4


def run_key(result: RolloutResult) -> str:
    """Return what names a run among those of one ``max_num_seqs``: its mode, and its policy with replicas."""
    return result.mode if result.lb_policy is None else f"{result.mode}/{result.lb_policy}"


def key_label(key: str) -> str:
    """Return the words for a :func:`run_key`."""
    mode, _, policy = key.partition("/")
    return MODE_LABELS[mode] + (f" ({policy})" if policy else "")


@dataclass(frozen=True)
class Comparison:
    """One mode's final latents against the reference mode's, request by request."""

    identical: int
    requests: int
    max_abs_difference: float


@dataclass(frozen=True)
class Exactness:
    """How each run's final latents compare with the first run's, at one ``max_num_seqs`` (runs by :func:`run_key`).

    With ``max_num_seqs`` 1 every request is encoded and denoised alone, so the cache must leave the
    latents bit-identical. With more, the cache's rows are encoded alone, which may round differently
    from the uncached batched encode, and vLLM-Omni denoises whichever requests are waiting together,
    which depends on timing (two uncached runs have differed too): the difference is reported and
    held to :data:`LATENT_TOLERANCE`, not to bit identity.
    """

    reference: str
    max_num_seqs: int
    compared: dict[str, Comparison]

    @property
    def bit_identity_expected(self) -> bool:
        return self.max_num_seqs == 1

    @property
    def all_identical(self) -> bool:
        return all(c.identical == c.requests for c in self.compared.values())

    @property
    def within_tolerance(self) -> bool:
        return all(c.max_abs_difference <= LATENT_TOLERANCE for c in self.compared.values())

    @property
    def passed(self) -> bool:
        return self.all_identical or (not self.bit_identity_expected and self.within_tolerance)


def check_exactness(results: Sequence[RolloutResult]) -> list[Exactness]:
    """Compare each mode's latents with the first mode's at the same ``max_num_seqs`` (the uncached one when it ran)."""
    checks = []
    for max_num_seqs, group in _by_max_num_seqs(results).items():
        if len(group) < 2:
            continue
        reference = group[0]
        compared = {}
        for result in group[1:]:
            differences = [
                (latents.float() - reference.latents[index].float()).abs().max().item()
                for index, latents in result.latents.items()
            ]
            compared[run_key(result)] = Comparison(
                identical=sum(
                    torch.equal(latents, reference.latents[index]) for index, latents in result.latents.items()
                ),
                requests=len(result.latents),
                max_abs_difference=max(differences, default=0.0),
            )
        checks.append(Exactness(run_key(reference), max_num_seqs, compared))
    return checks


def _by_max_num_seqs(results: Sequence[RolloutResult]) -> dict[int, list[RolloutResult]]:
    groups: dict[int, list[RolloutResult]] = {}
    for result in results:
        groups.setdefault(result.max_num_seqs, []).append(result)
    return groups


def encoder_share(result: RolloutResult) -> float:
    """Return the fraction of the rollout's time spent running the text encoder."""
    return result.encode_seconds / result.wall_seconds if result.wall_seconds else 0.0


def encoder_share_line(results: Sequence[RolloutResult]) -> str | None:
    """Return the sentence saying how much of the first uncached rollout was text encoding."""
    off = next((r for r in results if r.mode == "off"), None)
    if off is None:
        return None
    return f"Text encoding took {encoder_share(off):.0%} of the uncached rollout at max_num_seqs {off.max_num_seqs}."


def table_rows(results: Sequence[RolloutResult]) -> list[list[str]]:
    """Return the summary table: header first, then one row per run (max_num_seqs, mode, policy)."""
    if any(result.lb_policy is not None for result in results):
        return _replica_table_rows(results)
    rows = [
        [
            "max_num_seqs",
            "mode",
            "encode calls",
            "rows encoded",
            HITS.name,  # named as the counts they show
            MISSES.name,
            "bypassed",
            "row hits",
            "text-encode s",
            "rollout s",
            "speed-up",
        ]
    ]
    for group in _by_max_num_seqs(results).values():
        baseline = next((r for r in group if r.mode == "off"), group[0])
        for result in group:
            stats = result.stats
            rows.append(
                [
                    str(result.max_num_seqs),
                    MODE_LABELS[result.mode],
                    str(result.encoder_runs),
                    str(result.encoder_rows),
                    "-" if stats is None else str(stats.hits),
                    "-" if stats is None else str(stats.misses),
                    "-" if stats is None else str(stats.bypassed),
                    "-" if stats is None or result.mode != "ours" else str(stats.row_hits),
                    f"{result.encode_seconds:.2f}",
                    f"{result.wall_seconds:.2f}",
                    f"{baseline.wall_seconds / result.wall_seconds:.2f}x",
                ]
            )
    return rows


def _replica_table_rows(results: Sequence[RolloutResult]) -> list[list[str]]:
    """The table of runs with several replicas: where requests went and what each replica encoded."""
    rows = [
        [
            "max_num_seqs",
            "mode",
            "lb policy",
            "requests per replica",
            "encoder runs per replica",
            "encoder runs",
            HITS.name,
            MISSES.name,
            "peak load / bound",
            "rollout s",
        ]
    ]
    for result in results:
        stats = result.stats
        peak = None if result.routing is None else result.routing["peak_load_over_bound"]
        rows.append(
            [
                str(result.max_num_seqs),
                MODE_LABELS[result.mode],
                result.lb_policy or "-",
                " + ".join(map(str, result.requests_per_replica)),
                " + ".join(map(str, result.encoder_runs_per_replica)),
                str(result.encoder_runs),
                "-" if stats is None else str(stats.hits),
                "-" if stats is None else str(stats.misses),
                "-" if peak is None else f"{peak:.2f}",
                f"{result.wall_seconds:.2f}",
            ]
        )
    return rows


def replica_lines(spec: RolloutSpec, results: Sequence[RolloutResult]) -> list[str]:
    """Return what runs with replicas should be read against: the fewest encoder runs, the load bound."""
    if not any(result.lb_policy is not None for result in results):
        return []
    serving = min(len(spec.prompts), spec.replicas)  # replicas that get a prompt when prompts are spread
    fewest = len(spec.prompts) + (serving if spec.negative_prompt is not None else 0)
    lines = [
        f"Fewest text-encoder runs with {spec.replicas} replicas: {len(spec.prompts)} prompts, each on one replica, "
        f"plus the shared negative prompt once on each of the {serving} replicas serving them = {fewest}."
    ]
    for result in results:
        if result.routing is not None:
            placements = ", ".join(f"{count} {how}" for how, count in result.routing["placements"].items())
            fallbacks = result.routing["fallback_reasons"] or "none"
            lines.append(
                f"prompt-affinity at max_num_seqs {result.max_num_seqs} placed {placements}; fallbacks: {fallbacks}; "
                f"fullest replica at {result.routing['peak_load_over_bound']:.0%} of its bound "
                f"(ceil((1 + {result.routing['epsilon']:g}) x mean in-flight load))."
            )
    return lines


def bypass_lines(results: Sequence[RolloutResult]) -> list[str]:
    """Return one line per run that bypassed, with its reasons when the cache records them."""
    lines = []
    for result in results:
        stats = result.stats
        if stats is None or not stats.bypassed:
            continue
        detail = (
            "; ".join(f"{count} x {reason}" for reason, count in stats.bypass_reasons.items())
            if stats.bypass_reasons
            else "reasons not recorded by this cache (upstream counts bypasses only: every call with a tensor)"
        )
        lines.append(
            f"{key_label(run_key(result))} at max_num_seqs {result.max_num_seqs}: {stats.bypassed} bypassed - {detail}"
        )
    return lines


def _numeric_columns(rows: list[list[str]]) -> list[bool]:
    """Return, per column, whether every body cell is a number (right-aligned) or not (left-aligned)."""

    def numeric(cell: str) -> bool:
        try:
            float(cell.removesuffix("x"))
        except ValueError:
            return cell == "-"
        return True

    return [all(numeric(row[i]) for row in rows[1:]) for i in range(len(rows[0]))]


def render_table(rows: list[list[str]]) -> str:
    """Return ``rows`` as an aligned plain-text table: numbers right-aligned, text left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = _numeric_columns(rows)
    lines = []
    for number, row in enumerate(rows):
        cells = [
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(row, widths, numeric, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def render_markdown_table(rows: list[list[str]]) -> str:
    """Return ``rows`` as a Markdown table: numbers right-aligned, text left-aligned."""
    header, *body = rows
    alignment = ["---:" if right else "---" for right in _numeric_columns(rows)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(alignment) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def exactness_lines(checks: Sequence[Exactness]) -> list[str]:
    """Return one sentence per ``max_num_seqs`` stating how the latents compared."""
    if not checks:
        return ["Exactness: not checked (one mode per max_num_seqs)."]
    lines = []
    for check in checks:
        reference = key_label(check.reference)
        parts = ", ".join(
            f"{key_label(key)} {c.identical}/{c.requests} identical, max |diff| {c.max_abs_difference:.2g}"
            for key, c in check.compared.items()
        )
        if check.bit_identity_expected:
            verdict = "bit-identical" if check.all_identical else "NOT identical"
            lines.append(
                f"Exactness at max_num_seqs 1: final latents {verdict} to {reference} for the same seeds ({parts})."
            )
        else:
            verdict = f"within {LATENT_TOLERANCE:g}" if check.within_tolerance else f"NOT within {LATENT_TOLERANCE:g}"
            lines.append(
                f"At max_num_seqs {check.max_num_seqs}, final latents against {reference} ({parts}): {verdict}, "
                "not judged bit for bit: cached rows are encoded alone, which may round differently from one "
                "batched encode (benchmarks/encoder_batch_gap.py measures it), and which requests share a "
                "denoising batch depends on timing."
            )
    return lines


def summary(spec: RolloutSpec, results: Sequence[RolloutResult], checks: Sequence[Exactness]) -> dict[str, Any]:
    """Return every measured number, for the JSON file."""
    return {
        "spec": {
            "model_dir": str(spec.model_dir),
            "prompts": len(spec.prompts),
            "group_size": spec.group_size,
            "requests": len(spec.requests()),
            "negative_prompt": spec.negative_prompt,
            "height": spec.height,
            "width": spec.width,
            "steps": spec.steps,
            "true_cfg_scale": spec.true_cfg_scale,
            "step_execution": spec.step_execution,
            "replicas": spec.replicas,
            "arrival": spec.arrival,
        },
        "runs": [
            {
                "max_num_seqs": result.max_num_seqs,
                "mode": result.mode,
                "label": key_label(run_key(result)),
                "lb_policy": result.lb_policy,
                "requests_per_replica": list(result.requests_per_replica),
                "text_encoder_runs_per_replica": list(result.encoder_runs_per_replica),
                "routing": result.routing,
                "rollout_seconds": result.wall_seconds,
                "engine_init_seconds": result.engine_init_seconds,
                "text_encoder_runs": result.encoder_runs,
                "text_encoder_rows": result.encoder_rows,
                "text_encode_seconds": result.encode_seconds,
                "text_encoder_share": encoder_share(result),
                "cache_stats": None if result.stats is None else result.stats.as_dict(),
            }
            for result in results
        ],
        "exactness": [
            {
                "max_num_seqs": check.max_num_seqs,
                "reference": check.reference,
                "bit_identity_expected": check.bit_identity_expected,
                "all_identical": check.all_identical,
                "within_tolerance": check.within_tolerance,
                "tolerance": LATENT_TOLERANCE,
                "passed": check.passed,
                "compared": {mode: dataclasses.asdict(c) for mode, c in check.compared.items()},
            }
            for check in checks
        ],
    }


def write_chart(results: Sequence[RolloutResult], path: Path) -> None:
    """Write a PNG: per mode, rollout time split into text encoding and everything else."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = len({r.max_num_seqs for r in results}) > 1
    labels = [key_label(run_key(r)) + (f" @ {r.max_num_seqs}" if several else "") for r in results]
    encode = [r.encode_seconds for r in results]
    rest = [max(r.wall_seconds - r.encode_seconds, 0.0) for r in results]
    figure, axes = plt.subplots(figsize=(7, 1.6 + 0.65 * len(results)), dpi=120)
    axes.barh(labels, encode, color="#d1495b", label="text encoder")
    axes.barh(labels, rest, left=encode, color="#2e86ab", label="denoise, decode, engine")
    for y, result in enumerate(results):
        axes.text(result.wall_seconds, y, f" {result.wall_seconds:.1f} s", va="center", fontsize=9)
    axes.invert_yaxis()
    axes.set_xlabel("rollout wall time (s)")
    axes.set_title("Where the rollout's time went")
    axes.set_xlim(0, max(r.wall_seconds for r in results) * 1.18)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_report(
    out_dir: Path,
    spec: RolloutSpec,
    results: Sequence[RolloutResult],
    checks: Sequence[Exactness],
    command: str,
    environment: dict[str, str],
) -> list[Path]:
    """Write results.json and report.md into ``out_dir``; return their paths (the chart is separate)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    numbers = summary(spec, results, checks)
    numbers["environment"] = environment
    numbers["command"] = command
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(numbers, indent=2) + "\n")
    share_line = encoder_share_line(results)
    share = "" if share_line is None else share_line + "\n\n"
    bypasses = "\n".join(f"- {line}" for line in bypass_lines(results)) or "- none"
    replica_sentence = (
        f"The diffusion stage runs {spec.replicas} replicas, each with its own cache (vLLM-Omni's distributed "
        "runtime in one process); one engine per load-balancing policy.\n\n"
        if spec.replicas > 1
        else ""
    )
    replica_notes = "".join(f"{line}\n\n" for line in replica_lines(spec, results))
    report = f"""# GRPO rollout with and without the prompt-embed cache

{spec.group_size} sibling requests for each of {len(spec.prompts)} prompts ({len(spec.requests())} requests,
each with its own seed), sent concurrently ({spec.arrival}) to vLLM-Omni's `AsyncOmni`; every request carries the
token ids of its prompt and of a shared negative prompt (CFG {spec.true_cfg_scale}), and is encoded,
denoised for {spec.steps} steps at {spec.width}x{spec.height} and decoded. One engine per mode and
`max_num_seqs` (how many waiting requests vLLM-Omni's forward batches into one `encode_prompt`
call){"; step execution on" if spec.step_execution else ""}.

{replica_sentence}{render_markdown_table(table_rows(results))}

{replica_notes}{share}Bypasses:
{bypasses}

{chr(10).join(exactness_lines(checks))}

![where the time went](time.png)

Command: `{command}`

Environment: {", ".join(f"{key} {value}" for key, value in environment.items())}.
"""
    report_path = out_dir / "report.md"
    report_path.write_text(report)
    return [report_path, json_path]
