"""ci/mutation_guard.py [--list ci/mutations.yaml] [--jobs N]: tests catch the breaks they claim.

Each entry of the list is a deliberate break of one core rule (the hang bound's margin, a death
charged as a strike, teardown skipped, ...): a file, its exact text, the text put in its place,
and the tests that must fail with it. A green suite proves little if its tests still pass when the
rule they name is broken; this proves that they do not, rule by rule, on every CI run.

First the named tests run on an unmodified copy of the checkout (every one must pass, none may
skip: a skipped test catches nothing); then each break is applied to a copy of its own and its
tests run there, several copies at a time. The guard fails (exit 1) when a break survives (its
tests pass), when its text is not in its file exactly once, or when the baseline fails; a list it
cannot read is exit 2. The copies are taken from git's view of the checkout (tracked and
untracked files, not ignored ones), and the tests run with this interpreter, the copy first on
PYTHONPATH: the tests start `python -m ralph_runner` from their own checkout, the copy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

ROOT = Path(__file__).resolve().parents[1]
RUN_LIMIT_S = 300.0  # one copy's tests: a hang is a failure of the guard, not a wait forever


class Break(BaseModel):
    """One deliberate break: `find` (exactly once in `file`) becomes `replace`."""

    model_config = ConfigDict(extra="forbid")
    name: str
    file: str
    find: str
    replace: str
    tests: list[str] = Field(min_length=1)


class BreakList(BaseModel):
    model_config = ConfigDict(extra="forbid")
    breaks: list[Break] = Field(min_length=1)


@dataclass(frozen=True)
class TestRun:
    """One pytest run in one copy: its exit code, its counts from the JUnit file, its output."""

    exit_code: int
    passed: int
    failed: int
    skipped: int
    seconds: float
    output: str


@dataclass(frozen=True)
class Verdict:
    name: str
    caught: bool
    why: str
    seconds: float


def load(path: Path) -> BreakList:
    """The list, or exit 2 with where it is wrong (no traceback)."""
    try:
        return BreakList.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError) as error:
        print(f"{path}: {error}", file=sys.stderr)
        sys.exit(2)
    except ValidationError as error:
        where = "; ".join(
            f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        print(f"{path}: {where}", file=sys.stderr)
        sys.exit(2)


def text_problem(root: Path, item: Break) -> str | None:
    """Why the break cannot be applied to `root`'s file, or None."""
    path = root / item.file
    if not path.is_file():
        return f"{item.file} does not exist"
    count = path.read_text(encoding="utf-8").count(item.find)
    if count != 1:
        found = "not found" if count == 0 else f"found {count} times"
        return f"its text is {found} in {item.file}: {item.find!r}"
    return None


def checkout_files(root: Path) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (root / name).is_file()]


def copy_checkout(root: Path, files: list[str], into: Path) -> Path:
    for name in files:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    return into


def apply(copy: Path, item: Break) -> None:
    path = copy / item.file
    path.write_text(path.read_text(encoding="utf-8").replace(item.find, item.replace, 1), "utf-8")


def run_tests(copy: Path, tests: list[str], jobs: int = 1) -> TestRun:
    """The tests in `copy`, with its code first on the path; compiled first, as CI does (the
    tests start ralph-run many times, and PYTHONDONTWRITEBYTECODE may be set)."""
    compiled = [sys.executable, "-m", "compileall", "-q", "ralph_runner"]
    subprocess.run(compiled, cwd=copy, check=False)
    junit = copy / ".mutation-guard.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "RALPH_EVERY_TIER")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    command += ["-x", f"--junitxml={junit}", *(["-n", str(jobs)] if jobs > 1 else []), *tests]
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\nmutation guard: killed after {RUN_LIMIT_S:g} s"
    seconds = time.monotonic() - started
    passed = failed = skipped = 0
    if junit.is_file():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            if case.find("skipped") is not None:
                skipped += 1
            elif case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            else:
                passed += 1
    return TestRun(process.returncode, passed, failed, skipped, seconds, output)


def judge(item: Break, result: TestRun) -> Verdict:
    """Caught: pytest ran the tests and one failed (exit 1). Anything else is not a catch: all
    passed (the break survived), a skip, an import that broke collection, a run killed."""
    if result.exit_code == 1 and result.failed:
        return Verdict(item.name, True, f"{result.failed} test(s) failed", result.seconds)
    if result.exit_code == 0:
        why = f"survived: {result.passed} test(s) passed, {result.skipped} skipped"
    else:
        why = f"not a test failure (pytest exit {result.exit_code}): {tail(result.output)}"
    return Verdict(item.name, False, why, result.seconds)


def tail(output: str, lines: int = 8) -> str:
    return " | ".join(output.strip().splitlines()[-lines:])


def say_now(line: str) -> None:
    print(line, flush=True)  # CI's log shows each verdict as it comes


def guard(breaks: BreakList, root: Path, jobs: int, say: Callable[[str], None] = say_now) -> bool:
    """Baseline, then every break; True when every break was caught."""
    problems = [(b.name, p) for b in breaks.breaks if (p := text_problem(root, b))]
    for name, problem in problems:
        say(f"FAIL {name}: {problem}")
    if problems:
        return False
    every_test = list(dict.fromkeys(t for b in breaks.breaks for t in b.tests))
    with tempfile.TemporaryDirectory(prefix="mutation-guard-") as scratch:
        # one snapshot, taken now: every copy is of the same tree, whatever changes meanwhile
        files = checkout_files(root)
        pristine = copy_checkout(root, files, Path(scratch, "pristine"))
        baseline_copy = copy_checkout(pristine, files, Path(scratch, "baseline"))
        baseline = run_tests(baseline_copy, every_test, min(jobs, len(every_test)))
        say(
            f"baseline: {baseline.passed} passed, {baseline.failed} failed, {baseline.skipped}"
            f" skipped of {len(every_test)} named, {baseline.seconds:.0f} s"
        )
        if baseline.exit_code != 0 or baseline.skipped or baseline.failed:
            say(f"FAIL baseline: the named tests must pass unmodified: {tail(baseline.output, 20)}")
            return False

        def one(numbered: tuple[int, Break]) -> Verdict:
            number, item = numbered
            copy = copy_checkout(pristine, files, Path(scratch, f"break-{number}"))
            apply(copy, item)
            verdict = judge(item, run_tests(copy, item.tests))
            shutil.rmtree(copy, ignore_errors=True)
            word = "caught" if verdict.caught else "FAIL"
            say(f"{word} {verdict.name}: {verdict.why} ({verdict.seconds:.0f} s)")
            return verdict

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            verdicts = list(pool.map(one, enumerate(breaks.breaks)))
    survivors = [v for v in verdicts if not v.caught]
    say(f"mutation guard: {len(verdicts) - len(survivors)} of {len(verdicts)} breaks caught")
    return not survivors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/mutation_guard.py", description=__doc__)
    parser.add_argument("--list", type=Path, default=ROOT / "ci" / "mutations.yaml")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to copy")
    parser.add_argument("--jobs", type=int, default=max(2, os.cpu_count() or 2))
    parser.add_argument("--only", action="append", default=[], help="a break's name (repeat)")
    options = parser.parse_args(argv)
    breaks = load(options.list)
    if options.only:
        chosen = [b for b in breaks.breaks if b.name in options.only]
        if not chosen:
            print(f"{options.list}: no break named {options.only}", file=sys.stderr)
            return 2
        breaks = BreakList(breaks=chosen)
    started = time.monotonic()
    ok = guard(breaks, options.root.resolve(), options.jobs)
    say_now(f"mutation guard: {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
