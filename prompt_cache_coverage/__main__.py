"""``python -m prompt_cache_coverage [--write docs/coverage.md | --json]``: run every case, print the table.

Run it in a process of its own: some text stacks (vLLM's tensor-parallel layers) set up a one-rank
process group that stays for the life of the process. The classes the table must list are
enumerated from the installed vLLM-Omni (``classes.py``) after the cases ran, so that importing
every model module cannot change what a case measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pkgutil
import sys
from pathlib import Path

from prompt_cache_coverage.classes import PACKAGE, Enumeration, enumerate_classes
from prompt_cache_coverage.harness import NOT_BUILT, VERDICTS, Case, NotBuilt, Verdict, judge
from prompt_cache_coverage.paths import build_path
from vllm_omni_prompt_cache.calls.methods import ENCODE_PROMPT

BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
COMMAND = "python -m prompt_cache_coverage --write docs/coverage.md"


def all_cases() -> list[Case | NotBuilt]:
    package = importlib.import_module("prompt_cache_coverage")
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
        through = f"drives `{verdict.method}`" if verdict.method != ENCODE_PROMPT else ""
        why = "; ".join(part for part in (through, verdict.reason, verdict.note) if part)
        lines.append(
            f"| `{verdict.pipeline}` | {verdict.verdict} | {verdict.inputs} | "
            f"{yes[verdict.whole_call_hit] if verdict.verdict != NOT_BUILT else ''} | "
            f"{yes[verdict.rows] if verdict.verdict != NOT_BUILT else ''} | {gap} | "
            f"{paths.get(verdict.pipeline, '')} | {why.replace('|', '/')} |"
        )
    return "\n".join(lines)


def enumerated(classes: Enumeration) -> str:
    """Say where the table's class list comes from, and what the enumeration left out and why."""
    import vllm_omni

    said = (
        f"The {len(classes.classes)} classes are enumerated from the installed vLLM-Omni {vllm_omni.__version__} "
        f"(every module under `{PACKAGE}`, `prompt_cache_coverage/classes.py`); "
        "`tests/test_coverage.py` fails when one has no row or a row names no such class."
    )
    if classes.bases:
        said += " Left out as bases (unregistered, only inherited from): " + _names(classes.bases) + "."
    for module, broken in classes.unimportable.items():
        defines = ", ".join(f"`{name}`" for name in broken.encode_methods) or "no encode method"
        said += f" Not importable here: `{module}` ({broken.reason.replace('|', '/')}); its source defines {defines}."
    return said


def _names(classes: dict[str, str]) -> str:
    return ", ".join(f"`{name}`" for name in classes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prompt_cache_coverage")
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
    classes = enumerate_classes()
    if args.json:
        listed = {"verdicts": [dataclasses.asdict(v) for v in verdicts], "paths": paths}
        print(json.dumps({**listed, "enumerated": dataclasses.asdict(classes)}))
        return 0
    rendered = f"{table(verdicts, paths)}\n\n{enumerated(classes)}"
    print(rendered)
    if args.write is not None:
        text = args.write.read_text()
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        args.write.write_text(f"{head}{BEGIN}\n{rendered}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
