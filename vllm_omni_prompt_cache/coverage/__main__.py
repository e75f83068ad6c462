"""``python -m vllm_omni_prompt_cache.coverage [--write docs/coverage.md | --json]``: run every case, print the table.

Run it in a process of its own: some text stacks (vLLM's tensor-parallel layers) set up a one-rank
process group that stays for the life of the process.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pkgutil
import sys
from pathlib import Path

from vllm_omni_prompt_cache.coverage.harness import NOT_BUILT, VERDICTS, Case, NotBuilt, Verdict, judge
from vllm_omni_prompt_cache.coverage.paths import build_path

BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
COMMAND = "python -m vllm_omni_prompt_cache.coverage --write docs/coverage.md"


def all_cases() -> list[Case | NotBuilt]:
    package = importlib.import_module("vllm_omni_prompt_cache.coverage")
    cases: list[Case | NotBuilt] = []
    for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda found: found.name):
        if module.name.startswith("builders_"):
            cases.extend(importlib.import_module(f"{package.__name__}.{module.name}").CASES)
    return sorted(cases, key=lambda case: case.pipeline)


def summary(verdicts: list[Verdict]) -> str:
    """One line of counts by verdict, as the table below it holds them."""
    counts = {kind: sum(v.verdict == kind for v in verdicts) for kind in VERDICTS}
    return f"{len(verdicts)} classes: " + ", ".join(f"{count} {kind}" for kind, count in counts.items()) + "."


def table(verdicts: list[Verdict], paths: dict[str, str]) -> str:
    lines = [
        summary(verdicts),
        "",
        "| pipeline | verdict | inputs | whole-call hit | rows | vs uncached | built by / switch | why, or how |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for verdict in verdicts:
        gap = "" if verdict.gap is None else "exact" if verdict.gap == 0 else f"gap {verdict.gap:.1e}"
        yes = {True: "yes", False: "no"}
        why = "; ".join(part for part in (verdict.reason, verdict.note) if part)
        lines.append(
            f"| `{verdict.pipeline}` | {verdict.verdict} | {verdict.inputs} | "
            f"{yes[verdict.whole_call_hit] if verdict.verdict != NOT_BUILT else ''} | "
            f"{yes[verdict.rows] if verdict.verdict != NOT_BUILT else ''} | {gap} | "
            f"{paths.get(verdict.pipeline, '')} | {why.replace('|', '/')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_omni_prompt_cache.coverage")
    parser.add_argument("--write", type=Path, help="replace the table between the coverage marks of this file")
    parser.add_argument("--json", action="store_true", help="print the verdicts and build paths as JSON instead")
    args = parser.parse_args(argv)
    verdicts, paths = [], {}
    for case in all_cases():
        if isinstance(case, NotBuilt):
            verdicts.append(Verdict(case.pipeline, NOT_BUILT, reason=case.reason))
        else:
            verdicts.append(judge(case))
        paths[case.pipeline] = build_path(case.pipeline)
        print(f"{verdicts[-1].pipeline}: {verdicts[-1].verdict} {verdicts[-1].reason}", file=sys.stderr)
    if args.json:
        print(json.dumps({"verdicts": [dataclasses.asdict(v) for v in verdicts], "paths": paths}))
        return 0
    rendered = table(verdicts, paths)
    print(rendered)
    if args.write is not None:
        text = args.write.read_text()
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        args.write.write_text(f"{head}{BEGIN}\n{rendered}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
