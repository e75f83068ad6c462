"""Apply the upstream series one PR at a time to copies of installed vLLM-Omni wheels, and test each step.

Run through ``upstream/check.sh`` (not part of the proposed change). For each interpreter given (by
default the 0.30.0 one in ``.venv`` and the 0.32.0rc1 one of the release matrix), it copies that
interpreter's installed ``vllm_omni`` package into a scratch tree, then for each PR directory under
``upstream/series`` in order:

* applies its ``change.patch`` with ``patch -p1 --fuzz=0`` (a dry run first, so a PR that does not
  apply leaves the tree as it was);
* lints the files the series has touched so far with vLLM-Omni's ruff settings (``ruff check`` and
  ``ruff format --check``);
* runs every test the series has added so far, the public-contract tests in ``check/`` and, with
  ``--upstream-tests``, upstream's own ``test_prompt_embed_cache.py`` (tests whose meaning the series
  changes are strict expected failures, see ``check_plugin.py``);
* with a rollout size, sends a GRPO-shaped rollout through the real engine on the tree
  (``benchmarks/upstream_rollout.py``) and compares its latents with an uncached run on the stock tree;

and prints one line per PR. It exits 1 if any step fails to apply, any test fails, or a cached
rollout's latents differ from the uncached run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE.parent
ROOT = UPSTREAM.parent
SERIES = UPSTREAM / "series"
ROLLOUT = ROOT / "benchmarks" / "upstream_rollout.py"
CONTRACT_TESTS = HERE / "test_public_contract.py"
MODULE = "vllm_omni/diffusion/cache/prompt_embed_cache.py"
#: The wheels of the release matrix the series is checked on: (release, interpreter relative to ROOT).
DEFAULT_WHEELS = (
    ("0.30.0", ".venv/bin/python"),
    ("0.32.0rc1", ".nox/releases-vllm_omni-0-32-0rc1/bin/python"),
)


class StepFailed(Exception):
    """A step that did not apply, whose tests failed, or whose rollout went wrong."""


@dataclass(frozen=True)
class Step:
    """One PR of the series: its number, its directory's name and its patch."""

    number: int
    name: str
    patch: Path

    @property
    def label(self) -> str:
        return f"PR {self.number} {self.name}"


def series_steps(series: Path = SERIES) -> list[Step]:
    """The PRs in order: directories named ``<n>-<name>`` holding ``change.patch``."""
    steps = []
    for directory in series.iterdir():
        match = re.fullmatch(r"(\d+)-([a-z0-9-]+)", directory.name)
        if match and (directory / "change.patch").is_file():
            steps.append(Step(int(match.group(1)), match.group(2), directory / "change.patch"))
    steps.sort(key=lambda step: step.number)
    if [step.number for step in steps] != list(range(1, len(steps) + 1)):
        raise SystemExit(f"{series}: PR directories must be numbered 1..n, found {[s.number for s in steps]}")
    return steps


def changed_lines(patch: Path) -> dict[str, tuple[int, int]]:
    """Lines added and removed by a patch, per file it touches."""
    counts: dict[str, list[int]] = {}
    current = None
    for line in patch.read_text().splitlines():
        if line == "-- ":  # the signature git format-patch ends with
            break
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            counts[current] = [0, 0]
        elif current is None or line.startswith(("+++ ", "--- ")):
            continue
        elif line.startswith("+"):
            counts[current][0] += 1
        elif line.startswith("-"):
            counts[current][1] += 1
    return {path: (added, removed) for path, (added, removed) in counts.items()}


def apply(step: Step, root: Path) -> str:
    """Apply a step's patch to the tree at ``root`` (the directory holding ``vllm_omni``); say how it went."""
    command = ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch", "--batch", "-d", str(root), "-i", str(step.patch)]
    dry = subprocess.run([*command, "--dry-run"], capture_output=True, text=True)
    if dry.returncode != 0:
        merged = subprocess.run([*command, "--dry-run", "--reverse"], capture_output=True, text=True)
        if merged.returncode == 0:  # e.g. the sleep change, once #6952 is merged
            return "already in this tree (its reverse applies), skipped"
        raise StepFailed(f"{step.label} does not apply:\n{dry.stdout}{dry.stderr}")
    subprocess.run(command, capture_output=True, text=True, check=True)
    offsets = re.findall(r"offset (-?\d+) lines?", dry.stdout)
    at_offsets = f", {len(offsets)} hunk(s) at an offset ({', '.join(offsets)} lines)" if offsets else ""
    return f"applied, no fuzz{at_offsets}"


def build_tree(package: Path, destination: Path, steps: list[Step]) -> Path:
    """Copy an installed ``vllm_omni`` package to ``destination/vllm_omni``, apply ``steps``; return the tree root."""
    destination.mkdir(parents=True, exist_ok=True)
    # With its bytecode (copytree keeps the sources' times, so it stays valid): each interpreter that
    # imports the tree need not compile vLLM-Omni again; the files a patch changes are compiled afresh.
    shutil.copytree(package, destination / "vllm_omni")
    for step in steps:
        apply(step, destination)
    return destination


def step_module(package: Path, destination: Path, upto: int) -> Path:
    """Write ``prompt_embed_cache.py`` as of PR ``upto`` (0: the package's own) under ``destination``.

    Only the files the series touches are copied, so this is cheap enough for a benchmark or a test
    fixture that loads each step's module by path.
    """
    steps = series_steps()[:upto]
    touched = {path for step in steps for path in changed_lines(step.patch) if path.startswith("vllm_omni/")}
    for path in touched | {MODULE}:
        source = package.parent / path
        if source.is_file():
            (destination / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination / path)
    for step in steps:
        apply(step, destination)
    return destination / MODULE


def installed_package(python: str) -> tuple[Path, str]:
    """Where ``python``'s vllm_omni is installed, and its version (without importing vLLM)."""
    probe = (
        "import importlib.metadata, importlib.util; "
        "print(importlib.util.find_spec('vllm_omni').submodule_search_locations[0]); "
        "print(importlib.metadata.version('vllm-omni'))"
    )
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"{python}: no vllm-omni installed ({found.stderr.strip().splitlines()[-1:]})")
    location, version = found.stdout.split()
    return Path(location), version


def run_tests(python: str, root: Path, step: int, upstream_tests: Path | None) -> str:
    """Run the series' tests so far, the contract tests and upstream's (if given) in the tree; return the summary."""
    tests = sorted(str(path) for path in (root / "tests").rglob("test_*.py")) if (root / "tests").is_dir() else []
    environment = dict(
        os.environ,
        VLLM_OMNI_PROMPT_CACHE_PLUGIN="0",  # this repository's plugin, if installed, rebinds the module's names
        CHECK_VLLM_OMNI_DIR=str(root / "vllm_omni"),
        CHECK_STEP=str(step),
        PYTHONPATH=os.pathsep.join([str(root), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    # An empty config in the tree: no project's addopts (xdist workers, its own plugins) reach the run.
    config = root / "pytest-series.ini"
    config.write_text("[pytest]\n")
    command = [python, "-m", "pytest", "-c", str(config), "--rootdir", str(root)]
    command += ["-p", "check_plugin", "-p", "no:cacheprovider", "-q", "-rfExX"]
    command += ["-W", "ignore::pytest.PytestUnknownMarkWarning", *tests, str(CONTRACT_TESTS)]
    if upstream_tests is not None:
        command.append(str(upstream_tests))
    result = subprocess.run(command, capture_output=True, text=True, cwd=root, env=environment)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr.strip()
    if result.returncode != 0:
        raise StepFailed(f"tests failed at step {step}:\n{result.stdout[-6000:]}{result.stderr[-2000:]}")
    summary = re.sub(r" in [\d.]+s.*$", "", summary.strip("= "))  # the time first: what is appended stays
    for line in result.stdout.splitlines():
        if line.startswith("upstream's test_prompt_embed_cache.py:"):
            summary += f" ({line.split(': ', 1)[1]})"
    return summary


#: vLLM-Omni's ruff settings (its pyproject.toml and pre-commit hooks: ruff-check and ruff-format).
RUFF_CHECK = [
    "check", "--isolated", "--no-cache", "--line-length", "120", "--select", "E,W,F,I,N,UP",
    "--ignore", "E203,N801,N802,N806,N812", "--per-file-ignores", "tests/**:E501",
]  # fmt: skip
RUFF_FORMAT = ["format", "--isolated", "--no-cache", "--line-length", "120", "--check"]


def lint(root: Path, steps: list[Step]) -> str:
    """Lint what the series has touched so far, as vLLM-Omni's pre-commit would."""
    ruff = shutil.which("ruff", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if ruff is None:
        return "ruff not found, not linted"
    files = sorted({path for step in steps for path in changed_lines(step.patch) if path.endswith(".py")})
    for arguments in (RUFF_CHECK, RUFF_FORMAT):
        result = subprocess.run([ruff, *arguments, *files], capture_output=True, text=True, cwd=root)
        if result.returncode != 0:
            raise StepFailed(f"ruff {arguments[0]} fails on the series so far:\n{result.stdout}{result.stderr}")
    return "ruff check and format clean"


@dataclass(frozen=True)
class RolloutSize:
    prompts: int
    group_size: int
    steps: int

    def __str__(self) -> str:
        return f"{self.prompts} prompts x {self.group_size} siblings, {self.steps} steps"


def rollout(python: str, root: Path, size: RolloutSize, cached: bool, scratch: Path) -> dict:
    """One rollout through AsyncOmni on the tree; the uncached one saves its latents for the others."""
    reference, counts = scratch / "uncached-latents.pt", scratch / "rollout.json"
    counts.unlink(missing_ok=True)
    command = [python, str(ROLLOUT), str(root / "vllm_omni"), "--result", str(counts)]
    command += ["--cache", "on" if cached else "off"]
    command += ["--prompts", str(size.prompts), "--group-size", str(size.group_size), "--steps", str(size.steps)]
    command += ["--sleep", "--compare-latents", str(reference)] if cached else ["--save-latents", str(reference)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise StepFailed(f"the rollout failed:\n{result.stdout[-3000:]}{result.stderr[-6000:]}")
    return json.loads(counts.read_text())


def describe_rollout(run: dict, before: dict | None) -> str:
    text = f"rollout: {run['encodes']} encodes"
    if before is not None:
        text += f" (before this PR {before['encodes']})"
    cache = run["cache"]
    if cache is not None:
        text += f", {cache['hits']} hits, {cache['misses']} misses, {cache['bypassed']} bypassed"
    if "identical_latents" in run:
        text += f", latents identical to no cache {run['identical_latents']}/{run['requests']}"
    if run.get("entries_after_sleep") is not None:
        text += f", sleep(level=1): {run['entries']} -> {run['entries_after_sleep']} entries"
    return text


def check_wheel(
    python: str, release: str, steps: list[Step], size: RolloutSize | None, upstream: Path | None, printed: list[str]
) -> bool:
    """Check every step on a copy of ``python``'s vllm_omni; print a line per step; return True if all passed."""
    package, version = installed_package(python)
    if release and version != release:
        raise SystemExit(f"{python} has vLLM-Omni {version}, expected {release}")
    say(f"== vLLM-Omni {version} ({python}); tree copied from {package}", printed)
    with tempfile.TemporaryDirectory(prefix=f"series-{version}-") as scratch_name:
        scratch = Path(scratch_name)
        root = build_tree(package, scratch / "tree", [])
        upstream_tests = None
        if upstream is not None:
            upstream_tests = root / "tests" / "diffusion" / "cache" / "test_prompt_embed_cache.py"
            upstream_tests.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(upstream, upstream_tests)
        previous = None
        try:
            line = f"vLLM-Omni {version}, stock: tests {run_tests(python, root, 0, upstream_tests)}"
            if size is not None:
                uncached = rollout(python, root, size, cached=False, scratch=scratch)
                previous = rollout(python, root, size, cached=True, scratch=scratch)
                stock = describe_rollout(previous, None)
                line += f"; {size}: no cache {uncached['encodes']} encodes; stock cache {stock}"
            say(line, printed)
            for index, step in enumerate(steps):
                applied = apply(step, root)
                linted = lint(root, steps[: index + 1])
                lines = changed_lines(step.patch)
                module_added, module_removed = lines.get(MODULE, (0, 0))
                total_added, total_removed = (sum(counts[i] for counts in lines.values()) for i in (0, 1))
                tests = run_tests(python, root, step.number, upstream_tests)
                line = (
                    f"vLLM-Omni {version}, {step.label}: {applied}; {linted}; tests {tests}; "
                    f"lines changed: module +{module_added} -{module_removed} ({module_added + module_removed}), "
                    f"all files +{total_added} -{total_removed}"
                )
                if size is not None:
                    run = rollout(python, root, size, cached=True, scratch=scratch)
                    line += f"; {describe_rollout(run, previous)}"
                    if run["identical_latents"] != run["requests"]:
                        raise StepFailed(f"{line}\nthe cached rollout's latents differ from the uncached run's")
                    previous = run
                say(line, printed)
        except StepFailed as failure:
            say(f"vLLM-Omni {version}: FAILED: {failure}", printed)
            return False
    return True


def say(line: str, printed: list[str]) -> None:
    print(line, flush=True)
    printed.append(line)


def parse_size(text: str) -> RolloutSize | None:
    if text == "none":
        return None
    match = re.fullmatch(r"(\d+)x(\d+)(?:x(\d+))?", text)
    if match is None or 0 in (int(match.group(1)), int(match.group(2)), int(match.group(3) or 4)):
        raise argparse.ArgumentTypeError(f"--rollout {text!r}: expected PROMPTSxSIBLINGS[xSTEPS] (e.g. 8x16) or none")
    return RolloutSize(int(match.group(1)), int(match.group(2)), int(match.group(3) or 4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="upstream/check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python",
        action="append",
        metavar="PYTHON",
        help="an interpreter whose installed vllm_omni is copied and checked (repeatable; default: "
        + ", ".join(f"{path} ({release})" for release, path in DEFAULT_WHEELS)
        + ")",
    )
    parser.add_argument(
        "--rollout",
        type=parse_size,
        default=RolloutSize(8, 16, 4),
        metavar="PxK[xS]",
        help="the rollout each step sends through the real engine (default 8x16x4: 8 prompts x 16 siblings, "
        "4 denoising steps); none to skip",
    )
    parser.add_argument("--upto", type=int, metavar="N", help="stop after PR N")
    parser.add_argument("--write", type=Path, metavar="FILE", help="also write the lines printed, with the machine")
    parser.add_argument(
        "--upstream-tests",
        type=Path,
        metavar="FILE",
        help="upstream's tests/diffusion/cache/test_prompt_embed_cache.py from a source checkout, run at each step",
    )
    args = parser.parse_args(argv)
    steps = series_steps()
    if args.upto is not None:
        if not 1 <= args.upto <= len(steps):
            parser.error(f"--upto {args.upto}: the series has PRs 1..{len(steps)}")
        steps = steps[: args.upto]
    if args.upstream_tests is not None and not args.upstream_tests.is_file():
        parser.error(f"--upstream-tests {args.upstream_tests}: no such file")
    if shutil.which("patch") is None:
        parser.error("needs patch(1)")
    if args.python:
        wheels = [("", os.path.abspath(python) if os.sep in python else python) for python in args.python]
    else:
        wheels = [(release, str(ROOT / path)) for release, path in DEFAULT_WHEELS]
        missing = [f"{path} ({release})" for release, path in wheels if not Path(path).exists()]
        if missing:
            parser.error(f"no {', '.join(missing)}: run `make install` and `make releases-ci` first, or pass --python")
    printed: list[str] = []
    results = [
        check_wheel(python, release, steps, args.rollout, args.upstream_tests, printed) for release, python in wheels
    ]
    if args.write:
        args.write.write_text(record(printed, argv if argv is not None else sys.argv[1:], all(results)))
    return 0 if all(results) else 1


def record(printed: list[str], arguments: list[str], passed: bool) -> str:
    """The run as a results file: machine, date, commit, command, then every line printed."""
    try:
        from vllm_omni_prompt_cache.demo.machine import cpu_summary

        machine = cpu_summary()
    except ImportError:
        machine = "machine not described (vllm_omni_prompt_cache not importable)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        f"{machine}; {when} at commit {commit.stdout.strip() or 'unknown'} (the series as committed there).",
        "",
        "`" + " ".join(["upstream/check.sh", *arguments]) + "`",
        f"{'passed' if passed else 'FAILED'}:",
        "",
        "```text",
    ]
    return "\n".join([*header, *printed, "```"]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
