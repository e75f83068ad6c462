"""What the demo shows a person: a terminal table, and a Markdown report, JSON and a PNG chart."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_omni_prompt_cache.demo.rollout import RolloutResult, RolloutSpec

MODE_LABELS = {
    "off": "no cache",
    "stock": "vLLM-Omni 0.30 cache",
    "ours": "vllm-omni-prompt-cache",
}


@dataclass(frozen=True)
class Exactness:
    """Whether every request's final latents match the no-cache run bit for bit."""

    reference: str
    compared: dict[str, tuple[int, int]]  # mode -> (identical requests, requests)

    @property
    def all_identical(self) -> bool:
        return all(same == total for same, total in self.compared.values())


def check_exactness(results: Sequence[RolloutResult]) -> Exactness | None:
    """Compare each mode's latents with the first mode's (the uncached one when it ran)."""
    if len(results) < 2:
        return None
    reference = results[0]
    compared = {}
    for result in results[1:]:
        same = sum(torch.equal(latents, reference.latents[index]) for index, latents in result.latents.items())
        compared[result.mode] = (same, len(result.latents))
    return Exactness(reference.mode, compared)


def encoder_share(result: RolloutResult) -> float:
    """Return the fraction of the rollout's time spent running the text encoder."""
    return result.encode_seconds / result.wall_seconds if result.wall_seconds else 0.0


def table_rows(results: Sequence[RolloutResult]) -> list[list[str]]:
    """Return the summary table: header first, then one row per mode."""
    baseline = next((r for r in results if r.mode == "off"), results[0])
    rows = [
        [
            "mode",
            "text-encoder runs",
            "hits",
            "misses",
            "bypassed",
            "text-encode s",
            "rollout s",
            "speed-up",
        ]
    ]
    for result in results:
        stats = result.stats
        rows.append(
            [
                MODE_LABELS[result.mode],
                str(result.encoder_runs),
                "-" if stats is None else str(stats.hits),
                "-" if stats is None else str(stats.misses),
                "-" if stats is None else str(stats.bypassed),
                f"{result.encode_seconds:.2f}",
                f"{result.wall_seconds:.2f}",
                f"{baseline.wall_seconds / result.wall_seconds:.2f}x",
            ]
        )
    return rows


def bypass_lines(results: Sequence[RolloutResult]) -> list[str]:
    """Return one line per mode that bypassed, with its reasons when the cache records them."""
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
        lines.append(f"{MODE_LABELS[result.mode]}: {stats.bypassed} bypassed - {detail}")
    return lines


def render_table(rows: list[list[str]]) -> str:
    """Return ``rows`` as an aligned plain-text table."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for number, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def render_markdown_table(rows: list[list[str]]) -> str:
    """Return ``rows`` as a Markdown table."""
    header, *body = rows
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def exactness_line(exactness: Exactness | None) -> str:
    """Return the sentence that states the exactness check's outcome."""
    if exactness is None:
        return "Exactness: not checked (only one mode ran)."
    parts = [f"{MODE_LABELS[mode]} {same}/{total}" for mode, (same, total) in exactness.compared.items()]
    verdict = "bit-identical" if exactness.all_identical else "NOT identical"
    return (
        f"Exactness: final latents {verdict} to {MODE_LABELS[exactness.reference]} for the same seeds "
        f"({', '.join(parts)} requests)."
    )


def summary(spec: RolloutSpec, results: Sequence[RolloutResult], exactness: Exactness | None) -> dict[str, Any]:
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
        },
        "modes": {
            result.mode: {
                "label": MODE_LABELS[result.mode],
                "rollout_seconds": result.wall_seconds,
                "engine_init_seconds": result.engine_init_seconds,
                "text_encoder_runs": result.encoder_runs,
                "text_encode_seconds": result.encode_seconds,
                "text_encoder_share": encoder_share(result),
                "cache_stats": None if result.stats is None else result.stats.as_dict(),
            }
            for result in results
        },
        "exactness": None
        if exactness is None
        else {
            "reference": exactness.reference,
            "identical_requests": {mode: list(pair) for mode, pair in exactness.compared.items()},
            "all_identical": exactness.all_identical,
        },
    }


def write_chart(results: Sequence[RolloutResult], path: Path) -> None:
    """Write a PNG: per mode, rollout time split into text encoding and everything else."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [MODE_LABELS[r.mode] for r in results]
    encode = [r.encode_seconds for r in results]
    rest = [max(r.wall_seconds - r.encode_seconds, 0.0) for r in results]
    figure, axes = plt.subplots(figsize=(7, 3.6), dpi=120)
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
    exactness: Exactness | None,
    command: str,
    environment: dict[str, str],
) -> list[Path]:
    """Write results.json and report.md into ``out_dir``; return their paths (the chart is separate)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    numbers = summary(spec, results, exactness)
    numbers["environment"] = environment
    numbers["command"] = command
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(numbers, indent=2) + "\n")
    off = next((r for r in results if r.mode == "off"), None)
    share = "" if off is None else f"Text encoding took {encoder_share(off):.0%} of the uncached rollout.\n\n"
    bypasses = "\n".join(f"- {line}" for line in bypass_lines(results)) or "- none"
    report = f"""# GRPO rollout with and without the prompt-embed cache

{spec.group_size} sibling requests for each of {len(spec.prompts)} prompts ({len(spec.requests())} requests,
each with its own seed), sent concurrently to vLLM-Omni's `AsyncOmni`; every request carries the
token ids of its prompt and of a shared negative prompt (CFG {spec.true_cfg_scale}), and is encoded,
denoised for {spec.steps} steps at {spec.width}x{spec.height} and decoded. One engine per mode.

{render_markdown_table(table_rows(results))}

{share}Bypasses:
{bypasses}

{exactness_line(exactness)}

![where the time went](time.png)

Command: `{command}`

Environment: {", ".join(f"{key} {value}" for key, value in environment.items())}.
"""
    report_path = out_dir / "report.md"
    report_path.write_text(report)
    return [report_path, json_path]
