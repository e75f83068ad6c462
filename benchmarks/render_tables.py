"""Print Markdown tables from a pytest-benchmark JSON file written by the benchmarks in this folder.

    python benchmarks/render_tables.py benchmarks/results/keys.json

One table per benchmark group, rows in the order they ran. Ratios compare best (min) times from
the same run: every "alternative" row against the group's "ours" row, and "ours" against a
"reference" row as a percentage (roles come from each benchmark's ``extra_info``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_omni_prompt_cache.demo.machine import SPEED_FLAGS as SIMD_FLAGS


def machine_line(report: dict) -> str:
    """Return one line naming the machine, versions and commit the numbers came from."""
    machine = report["machine_info"]
    commit = report.get("commit_info", {})
    model = machine.get("lscpu_model_name") or machine.get("cpu", {}).get("brand_raw", "unknown CPU")
    present = machine.get("simd_flags", [])
    missing = [flag for flag in SIMD_FLAGS if flag not in present]
    flags = ", ".join(present) or "none of " + "/".join(SIMD_FLAGS)
    if present and missing:
        flags += "; no " + "/".join(missing)
    memory = f", {machine['memory_gib']} GiB" if machine.get("memory_gib") else ""
    revision = ""
    if commit.get("id"):
        revision = f" at commit {commit['id'][:7]}" + (" plus uncommitted changes" if commit.get("dirty") else "")
    return (
        f"{model} ({flags}), {machine.get('cpus_available', '?')} CPUs{memory}, {machine['machine']}; "
        f"Python {machine['python_version']}, torch {machine.get('torch_version', '?')} "
        f"({machine.get('torch_threads', '?')} threads), xxhash {machine.get('xxhash_version', '?')}; "
        f"pytest-benchmark {report.get('version', '?')}, {report['datetime'][:16].replace('T', ' ')} UTC{revision}."
    )


def comparison(row: dict, ours: dict | None, reference: dict | None) -> str:
    """Return the comparison cell for one row: a ratio against ours, or ours against the reference."""
    role = row["extra_info"].get("role")
    best = row["stats"]["min"]
    if role == "ours":
        return f"{best / reference['stats']['min']:.3%} of one encode" if reference else "baseline"
    if role != "alternative" or ours is None:
        return ""
    ours_best = ours["stats"]["min"]
    if best >= ours_best:
        return f"ours is {best / ours_best:.2f}x faster"
    return f"ours takes {ours_best / best:.2f}x as long"


def group_table(group: str, rows: list[dict]) -> list[str]:
    """Return the Markdown lines of one group's table."""
    ours = next((row for row in rows if row["extra_info"].get("role") == "ours"), None)
    reference = next((row for row in rows if row["extra_info"].get("role") == "reference"), None)
    lines = [
        f"**{group}**",
        "",
        "| variant | best (us) | median (us) | rounds x calls | comparison |",
        "|---|---:|---:|---:|---|",
    ]
    for row in rows:
        stats = row["stats"]
        label = row["extra_info"].get("variant", row["name"])
        lines.append(
            f"| {label} | {stats['min'] * 1e6:,.2f} | {stats['median'] * 1e6:,.2f} | "
            f"{stats['rounds']} x {stats['iterations']} | {comparison(row, ours, reference)} |"
        )
    return lines


def render(report: dict) -> str:
    """Return the whole Markdown: the machine line, then one table per group."""
    groups: dict[str, list[dict]] = {}
    for row in report["benchmarks"]:
        groups.setdefault(row["group"] or "(no group)", []).append(row)
    lines = [machine_line(report)]
    for group, rows in groups.items():
        lines += ["", *group_table(group, rows)]
    return "\n".join(lines)


#: The rendered tables replace whatever stands between these two lines of a Markdown file.
BEGIN_MARK = "<!-- tables rendered by benchmarks/render_tables.py: begin -->"
END_MARK = "<!-- tables rendered by benchmarks/render_tables.py: end -->"


def write_into(markdown: Path, tables: str) -> None:
    """Replace the text between :data:`BEGIN_MARK` and :data:`END_MARK` in ``markdown`` with ``tables``."""
    text = markdown.read_text()
    if text.count(BEGIN_MARK) != 1 or text.count(END_MARK) != 1:
        raise SystemExit(f"{markdown}: needs exactly one {BEGIN_MARK!r} and one {END_MARK!r} line")
    head, rest = text.split(BEGIN_MARK)
    _, tail = rest.split(END_MARK)
    markdown.write_text(f"{head}{BEGIN_MARK}\n\n{tables}\n\n{END_MARK}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="a file written by pytest --benchmark-json")
    parser.add_argument("--write-into", type=Path, help="also put the tables between the marks in this Markdown file")
    args = parser.parse_args()
    tables = render(json.loads(args.json.read_text()))
    print(tables)
    if args.write_into is not None:
        write_into(args.write_into, tables.strip())


if __name__ == "__main__":
    main()
