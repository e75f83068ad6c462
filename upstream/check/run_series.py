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
  ``--upstream-tests``, upstream's own test files as the series has edited them so far: a PR that
  retires a tested behaviour edits that test in the same patch, so every upstream test must pass
  at every step (see "Upstream's test files" below);
* with a rollout size, sends a GRPO-shaped rollout through the real engine on the tree
  (``benchmarks/upstream_rollout.py``) and compares its latents with an uncached run on the stock tree;

and prints one line per PR. It exits 1 if any step fails to apply, any test fails, or a cached
rollout's latents differ from the uncached run's.

Upstream's test files are not in a wheel, and this repository does not carry them: whoever runs the
check reads them from vLLM-Omni's source (or the code index) into a scratch path and passes each with
``--upstream-tests``. Each is placed at its path in the tree before the stock step, so each PR's edits
to it apply as the patch says. Without them, a patch's hunks for those files are not applied (the line
says so) and the PRs' own tests run. ``test_diffusion_worker.py`` is read from vLLM-Omni's main branch,
which is newer than the wheels: only its ``TestDiffusionWorkerSleep`` class (the sleep tests, with the
fixtures and helpers it uses and the imports they need) is run, and a test of that class that already
fails on the stock wheel (it tests main's worker, not the wheel's) is deselected at every step and named
on the stock line.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE.parent
ROOT = UPSTREAM.parent
SERIES = UPSTREAM / "series"
ROLLOUT = ROOT / "benchmarks" / "upstream_rollout.py"
CONTRACT_TESTS = HERE / "test_public_contract.py"
MODULE = "vllm_omni/diffusion/cache/prompt_embed_cache.py"
HARDWARE_MARK = HERE / "upstream_hardware_mark.py"  # tests/helpers/mark.py for the series' CUDA test
#: Upstream's test files a PR of the series may edit, by file name: where each lives in vLLM-Omni's source,
#: and the test class to run from it (None: the whole file).
UPSTREAM_TEST_FILES = {
    "test_prompt_embed_cache.py": ("tests/diffusion/cache/test_prompt_embed_cache.py", None),
    "test_diffusion_worker.py": ("tests/diffusion/test_diffusion_worker.py", "TestDiffusionWorkerSleep"),
}
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


def file_patches(patch: Path) -> dict[str, str]:
    """A ``git format-patch`` file split into the diff of each file it touches (path -> diff text)."""
    pieces: dict[str, list[str]] = {}
    current = None
    for line in patch.read_text().splitlines(keepends=True):
        if line.rstrip("\n") == "-- ":  # the signature git format-patch ends with
            break
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1].rstrip("\n")
            pieces[current] = []
        if current is not None:
            pieces[current].append(line)
    return {path: "".join(lines) for path, lines in pieces.items()}


def patch_digest(patch: Path) -> str:
    """The first 12 hex digits of a patch file's sha256: what a recorded run names the patches it checked by."""
    return hashlib.sha256(patch.read_bytes()).hexdigest()[:12]


def changed_lines(patch: Path) -> dict[str, tuple[int, int]]:
    """Lines added and removed by a patch, per file it touches."""
    counts = {}
    for path, diff in file_patches(patch).items():
        lines = [line for line in diff.splitlines() if not line.startswith(("+++ ", "--- "))]
        counts[path] = (sum(line.startswith("+") for line in lines), sum(line.startswith("-") for line in lines))
    return counts


UPSTREAM_TEST_PATHS = {path for path, _ in UPSTREAM_TEST_FILES.values()}


def apply(step: Step, root: Path) -> str:
    """Apply a step's patch to the tree at ``root`` (the directory holding ``vllm_omni``); say how it went.

    Its edits of upstream's test files apply where the tree holds them (``--upstream-tests``); elsewhere they are
    left out, and the result says so."""
    pieces = file_patches(step.patch)
    left_out = [path for path in pieces if path in UPSTREAM_TEST_PATHS and not (root / path).is_file()]
    diff = "".join(text for path, text in pieces.items() if path not in left_out)
    # --forward: --batch alone would take a patch already in the tree for a reversed one and undo it.
    command = ["patch", "-p1", "--fuzz=0", "--forward", "--no-backup-if-mismatch", "--batch", "-d", str(root)]
    dry = subprocess.run([*command, "--dry-run"], input=diff, capture_output=True, text=True)
    if dry.returncode != 0:
        merged = subprocess.run([*command, "--dry-run", "--reverse"], input=diff, capture_output=True, text=True)
        if merged.returncode == 0:  # e.g. the sleep change, once #6952 is merged
            return "already in this tree (its reverse applies), skipped"
        raise StepFailed(f"{step.label} does not apply:\n{dry.stdout}{dry.stderr}")
    subprocess.run(command, input=diff, capture_output=True, text=True, check=True)
    offsets = re.findall(r"offset (-?\d+) lines?", dry.stdout)
    at_offsets = f", {len(offsets)} hunk(s) at an offset ({', '.join(offsets)} lines)" if offsets else ""
    counts = changed_lines(step.patch)
    upstream_edits = [path for path in pieces if path in UPSTREAM_TEST_PATHS]
    edits = [f"upstream's {path} +{counts[path][0]} -{counts[path][1]}" for path in upstream_edits]
    edited = ""
    if edits:
        edited = f", edits {', '.join(edits)}"
        if left_out:
            edited += f" ({', '.join(Path(path).name for path in left_out)} not given: not applied)"
    return f"applied, no fuzz{at_offsets}{edited}"


def build_tree(package: Path, destination: Path, steps: list[Step]) -> Path:
    """Copy an installed ``vllm_omni`` package to ``destination/vllm_omni``, apply ``steps``; return the tree root."""
    destination.mkdir(parents=True, exist_ok=True)
    # With its bytecode (copytree keeps the sources' times, so it stays valid): each interpreter that
    # imports the tree need not compile vLLM-Omni again; the files a patch changes are compiled afresh.
    shutil.copytree(package, destination / "vllm_omni")
    helpers = destination / "tests" / "helpers" / "mark.py"  # what the series' CUDA test imports (no wheel has it)
    helpers.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(HARDWARE_MARK, helpers)
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


def only_class(source: str, name: str) -> str:
    """Return a test file's source with one of its test classes only: its other test classes and test functions
    go (helper classes stay), and so do the imports nothing left uses (vLLM-Omni's main branch imports names an
    older wheel lacks)."""
    tree = ast.parse(source)
    kept = [
        node
        for node in tree.body
        if not (isinstance(node, ast.ClassDef) and node.name != name and node.name.startswith("Test"))
        and not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"))
    ]
    if not any(isinstance(node, ast.ClassDef) and node.name == name for node in kept):
        raise StepFailed(f"upstream's test file has no class {name}")
    body = [node for node in kept if not isinstance(node, (ast.Import, ast.ImportFrom))]
    used = {node.id for part in body for node in ast.walk(part) if isinstance(node, ast.Name)}
    for node in kept:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
            isinstance(node, ast.ImportFrom) and node.module == "__future__"
        ):
            node.names = [alias for alias in node.names if (alias.asname or alias.name).split(".")[0] in used]
    tree.body = [node for node in kept if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.names]
    return ast.unparse(tree) + "\n"


@dataclass
class TestRun:
    """One step's test run: its summary, and the upstream tests that failed in it."""

    summary: str
    upstream_failures: list[str]


def run_tests(python: str, root: Path, step: int, upstream: list[str], deselected: list[str]) -> TestRun:
    """Run the series' tests so far, the contract tests and upstream's (paths in the tree) in the tree."""
    found = (root / "tests").rglob("test_*.py")
    tests = sorted(str(path) for path in found if str(path.relative_to(root)) not in UPSTREAM_TEST_PATHS)
    targets = []
    for relative in upstream:
        place, only = next((path, cls) for path, cls in UPSTREAM_TEST_FILES.values() if path == relative)
        if only is None:
            targets.append(str(root / place))
            continue
        extract = root / "upstream-run" / f"{Path(place).stem}__{only}.py"
        extract.parent.mkdir(exist_ok=True)
        extract.write_text(only_class((root / place).read_text(), only))
        targets.append(f"{extract}::{only}")
    environment = dict(
        os.environ,
        VLLM_OMNI_PROMPT_CACHE_PLUGIN="0",  # this repository's plugin, if installed, rebinds the module's names
        CHECK_VLLM_OMNI_DIR=str(root / "vllm_omni"),
        CHECK_STEP=str(step),
        PYTHONPATH=os.pathsep.join([str(root), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    # An empty config in the tree: no project's addopts (xdist workers, its own plugins) reach the run.
    config = root / "pytest-series.ini"
    config.write_text("[pytest]\njunit_family = xunit1\n")
    report = root / "pytest-series.xml"
    command = [python, "-m", "pytest", "-c", str(config), "--rootdir", str(root), "--junitxml", str(report)]
    command += ["-p", "check_plugin", "-p", "no:cacheprovider", "-q", "-rfE"]
    command += ["-W", "ignore::pytest.PytestUnknownMarkWarning", *tests, str(CONTRACT_TESTS), *targets]
    for nodeid in deselected:
        command += ["--deselect", nodeid]
    report.unlink(missing_ok=True)
    result = subprocess.run(command, capture_output=True, text=True, cwd=root, env=environment)
    if not report.is_file():
        raise StepFailed(f"pytest did not run at step {step}:\n{result.stdout[-6000:]}{result.stderr[-2000:]}")
    counts, per_file, failures = _outcomes(report, root)
    if counts["xfailed"]:
        raise StepFailed(f"{counts['xfailed']} test(s) ran as expected failures at step {step}: none may")
    upstream_failures = [nodeid for nodeid in failures if nodeid.startswith("upstream-run/")]
    if result.returncode != 0 and (set(failures) - set(upstream_failures) or step > 0 or not upstream_failures):
        raise StepFailed(f"tests failed at step {step}:\n{result.stdout[-6000:]}{result.stderr[-2000:]}")
    summary = f"{counts['passed']} passed, failed {counts['failed']}"
    summary += "".join(f", {counts[kind]} {kind}" for kind in ("skipped",) if counts[kind])
    upstream_counts = []
    for target in targets:
        path, _, only = target.partition("::")
        outcome = per_file.get(Path(path).name, Counter())
        text = f"{only or Path(path).name} {outcome['passed']} passed, failed {outcome['failed']}"
        upstream_counts.append(text + (f", {len(deselected)} deselected" if only and deselected else ""))
    if upstream_counts:
        summary += f" (upstream's: {'; '.join(upstream_counts)})"
    return TestRun(summary, upstream_failures)


def _outcomes(report: Path, root: Path) -> tuple[Counter, dict[str, Counter], list[str]]:
    """Read a junit report: counts by outcome, per test file, and the node ids that failed or errored."""
    counts: Counter = Counter()
    per_file: dict[str, Counter] = {}
    failures = []
    for case in ElementTree.parse(report).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        counts[outcome] += 1
        file = case.get("file", "")
        per_file.setdefault(Path(file).name, Counter())[outcome] += 1
        if outcome == "failed":
            cls = case.get("classname", "").rsplit(".", 1)[-1]
            failures.append(f"{file}::{cls}::{case.get('name')}")
    return counts, per_file, failures


#: vLLM-Omni's ruff settings (its pyproject.toml and pre-commit hooks: ruff-check and ruff-format).
RUFF_CHECK = [
    "check", "--isolated", "--no-cache", "--target-version", "py310", "--line-length", "120",
    "--select", "E,W,F,I,N,UP", "--ignore", "E203,N801,N802,N806,N812", "--per-file-ignores", "tests/**:E501",
]  # fmt: skip
RUFF_FORMAT = ["format", "--isolated", "--no-cache", "--target-version", "py310", "--line-length", "120", "--check"]


def lint(root: Path, steps: list[Step]) -> str:
    """Lint what the series has touched so far, as vLLM-Omni's pre-commit would."""
    ruff = shutil.which("ruff", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if ruff is None:
        return "ruff not found, not linted"
    touched = {path for step in steps for path in changed_lines(step.patch) if path.endswith(".py")}
    files = sorted(path for path in touched if (root / path).is_file())
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
    python: str, release: str, steps: list[Step], size: RolloutSize | None, upstream: list[Path], printed: list[str]
) -> bool:
    """Check every step on a copy of ``python``'s vllm_omni; print a line per step; return True if all passed."""
    package, version = installed_package(python)
    if release and version != release:
        raise SystemExit(f"{python} has vLLM-Omni {version}, expected {release}")
    say(f"== vLLM-Omni {version} ({python}); tree copied from {package}", printed)
    with tempfile.TemporaryDirectory(prefix=f"series-{version}-") as scratch_name:
        scratch = Path(scratch_name)
        root = build_tree(package, scratch / "tree", [])
        upstream_tests = []
        for given in upstream:
            place = root / UPSTREAM_TEST_FILES[given.name][0]
            place.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(given, place)
            upstream_tests.append(UPSTREAM_TEST_FILES[given.name][0])
        previous = None
        try:
            stock = run_tests(python, root, 0, upstream_tests, [])
            deselected = stock.upstream_failures  # tests of main's worker that this wheel's fails already
            if deselected:
                stock = run_tests(python, root, 0, upstream_tests, deselected)
                if " 0 passed" in stock.summary.split("upstream's:", 1)[-1]:
                    raise StepFailed(f"every test of an upstream class fails on the stock wheel: {deselected}")
            line = f"vLLM-Omni {version}, stock: tests {stock.summary}"
            if any(Path(path).name == "test_diffusion_worker.py" for path in upstream_tests):
                line += "; in upstream's worker tests a mocked runner's _kv_receive_progress is None (check_plugin.py)"
            if deselected:
                names = ", ".join(nodeid.rsplit("::", 1)[1] for nodeid in deselected)
                line += f"; deselected at every step, failing on this stock wheel: {names}"
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
                tests = run_tests(python, root, step.number, upstream_tests, deselected).summary
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
        action="append",
        default=[],
        metavar="FILE",
        help="one of upstream's test files the series edits, read from vLLM-Omni's source into a scratch path, "
        f"run at each step with the series' edits (repeatable; by name: {', '.join(UPSTREAM_TEST_FILES)})",
    )
    args = parser.parse_args(argv)
    steps = series_steps()
    if args.upto is not None:
        if not 1 <= args.upto <= len(steps):
            parser.error(f"--upto {args.upto}: the series has PRs 1..{len(steps)}")
        steps = steps[: args.upto]
    if args.write is not None and not args.write.parent.is_dir():
        parser.error(f"--write {args.write}: no such directory {args.write.parent}")
    for given in args.upstream_tests:
        if not given.is_file():
            parser.error(f"--upstream-tests {given}: no such file")
        if given.name not in UPSTREAM_TEST_FILES:
            parser.error(f"--upstream-tests {given}: expected one of upstream's {', '.join(UPSTREAM_TEST_FILES)}")
    if len({given.name for given in args.upstream_tests}) != len(args.upstream_tests):
        parser.error("--upstream-tests: each of upstream's files at most once")
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
    dirty = subprocess.run(["git", "status", "--porcelain", "upstream"], capture_output=True, text=True, cwd=ROOT)
    series = "the series with uncommitted changes" if dirty.stdout.strip() else "the series as committed there"
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    digests = ", ".join(f"PR {step.number} {patch_digest(step.patch)}" for step in series_steps())
    header = [
        f"{machine}; {when} at commit {commit.stdout.strip() or 'unknown'} ({series}).",
        "",
        f"Patches (sha256 of each change.patch): {digests}.",
        "",
        "`" + " ".join(["upstream/check.sh", *arguments]) + "`",
        f"{'passed' if passed else 'FAILED'}:",
        "",
        "```text",
    ]
    return "\n".join([*header, *printed, "```"]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
