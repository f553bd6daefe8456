"""Mutation testing of corral's core rules: ``python -m testkit.mutation``, one score per module.

A test suite proves what it claims only if breaking the code breaks a test. mutmut makes
one-line changes to the rules' modules (a ``<`` for a ``<=``, a term dropped from a
``max``, a constant changed, a condition negated), one at a time, and runs the tests
that cover the changed function; a mutant no test fails on *survived*, a mutant in code
no selected test runs has *no tests*. Both count against the score:

    score = (killed + timed out) / every mutant

The modules and the tests run against them are mutmut's configuration in
``pyproject.toml`` (``[tool.mutmut]``: ``only_mutate`` and
``pytest_add_cli_args_test_selection``; the tests run in one process on SQLite, ``-k "not
postgres"``). This command runs mutmut over them (in ``mutants/``, a copy of the tree; the
checkout itself is never changed), then prints each module's score and every mutant that
was not killed - ``mutmut show NAME`` shows its diff - and exits 1 when the whole is below
``--aim`` (90 % by default). mutmut keeps its results in ``mutants/`` and runs again only
what changed since (a mutant of a function whose code changed is tested again); after
tests were added, ``--recheck`` tests again every mutant not killed; ``--fresh`` starts
over, and is needed after a module is added to ``only_mutate`` (mutmut takes its earlier
plain copy in ``mutants/`` for an already mutated file) or the test selection changes
(mutmut then forgets every result anyway). Naming modules (``python -m testkit.mutation
workers/maintenance/reaper.py``) tests only theirs: a long run can be done a module at a
time. docs/benchmarks.md ("Mutation testing") has the last scores.

mutmut stops a mutant's tests at the first failure (``-x``), so their order is its speed:
under mutmut, tests/conftest.py runs a mutant's likeliest killers first
(:func:`kill_order`: its module's own test file, then the quickest tests).
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
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
TEXTS = "corral-function-texts.json"  # in mutants/: each mutated function's text, hashed
DETECTED = {"killed", "timeout"}


@dataclass
class Score:
    """One module's mutants, by outcome."""

    path: str
    outcomes: Counter[str] = field(default_factory=Counter)
    undetected: list[tuple[str, str]] = field(default_factory=list)  # (mutant, outcome)

    @property
    def total(self) -> int:
        """Every mutant of the module."""
        return sum(self.outcomes.values())

    @property
    def detected(self) -> int:
        """Mutants a test failed on (or ran too long with)."""
        return sum(n for outcome, n in self.outcomes.items() if outcome in DETECTED)

    @property
    def percent(self) -> float:
        """Detected mutants as a percentage of all (100 for a module with none)."""
        return 100.0 * self.detected / self.total if self.total else 100.0


def modules(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The modules mutated: ``[tool.mutmut] only_mutate``."""
    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["tool"]["mutmut"]["only_mutate"])


def source_paths(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The trees mutmut copies: ``[tool.mutmut] source_paths``."""
    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["tool"]["mutmut"]["source_paths"])


def scores(paths: list[str], mutants: Path = MUTANTS) -> list[Score]:
    """Each module's outcomes, read from mutmut's results (``mutants/<path>.meta``)."""
    from mutmut.stats import status_by_exit_code  # (mutmut only here: tests import kill_order)

    out = []
    for path in paths:
        score = Score(path)
        meta = mutants / f"{path}.meta"
        if meta.exists():
            for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                outcome = status_by_exit_code[code]
                score.outcomes[outcome] += 1
                if outcome not in DETECTED:
                    score.undetected.append((name, outcome))
        out.append(score)
    return out


def report(all_scores: list[Score]) -> str:
    """The scores as a table, then every mutant not detected."""
    lines = [f"{'module':<36}{'mutants':>8}{'killed':>8}{'survived':>9}{'no tests':>9}{'score':>8}"]
    for s in all_scores:
        lines.append(
            f"{s.path:<36}{s.total:>8}{s.detected:>8}{s.outcomes['survived']:>9}"
            f"{s.outcomes['no tests']:>9}{s.percent:>7.1f}%"
        )
    total = sum(s.total for s in all_scores)
    detected = sum(s.detected for s in all_scores)
    whole = 100.0 * detected / total if total else 100.0
    lines.append(f"{'all':<36}{total:>8}{detected:>8}{'':>18}{whole:>7.1f}%")
    missed = [m for s in all_scores for m in s.undetected]
    if missed:
        lines += ["", "not detected (mutmut show NAME):"]
        lines += [f"  {outcome:<12} {name}" for name, outcome in missed]
    return "\n".join(lines)


def to_test(paths: list[str], recheck: bool, mutants: Path = MUTANTS) -> list[str]:
    """What to name to mutmut for ``paths``: their mutants not yet tested (or, to recheck,
    not detected); a module never generated yet, all of its mutants (a pattern)."""
    names: list[str] = []
    for score in scores(paths, mutants):
        if not (mutants / f"{score.path}.meta").exists():
            names.append(score.path.removesuffix(".py").replace("/", ".") + ".*")
        else:
            names += [n for n, outcome in score.undetected if recheck or outcome == "not checked"]
    return names


def function_texts(source: str) -> dict[str, str]:
    """Each function of ``source`` by mutmut's key (``x_f``, ``x\u01c1Class\u01c1f``): its lines,
    comments included, hashed."""
    from mutmut.mutation.trampoline_templates import mangle_function_name  # (as in scores)

    lines = source.splitlines()
    out: dict[str, str] = {}

    def visit(body: list[ast.stmt], cls: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                key = mangle_function_name(name=node.name, class_name=cls or None)
                text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                out[key] = hashlib.sha256(text.encode()).hexdigest()[:12]
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{cls}.{node.name}" if cls else node.name)

    visit(ast.parse(source).body, "")
    return out


def forget_recommented(paths: list[str], root: Path = ROOT, mutants: Path = MUTANTS) -> list[str]:
    """Have mutmut test again every function of ``paths`` whose text changed since the last
    run though its code did not; the functions (``path:key``).

    mutmut keys a result by the mutant's number in its function and keeps the results of
    a function whose code (its AST, comments left out) is unchanged; a ``# pragma: no
    mutate`` added there renumbers the mutants after it, and the results would be read
    against the wrong mutants. So the function's results are forgotten here (``None``:
    not checked), before mutmut runs.
    """
    store = mutants / TEXTS
    known: dict[str, dict[str, str]] = json.loads(store.read_text()) if store.exists() else {}
    forgotten: list[str] = []
    for path in paths:
        texts = function_texts((root / path).read_text())
        before, meta_path = known.get(path), mutants / f"{path}.meta"
        if before is not None and meta_path.exists():
            meta = json.loads(meta_path.read_text())
            codes = meta["exit_code_by_key"]
            changed = {k for k in before.keys() | texts.keys() if before.get(k) != texts.get(k)}
            prefix = path.removesuffix(".py").replace("/", ".") + "."
            for name in codes:
                key = name.removeprefix(prefix).rpartition("__mutmut_")[0]
                if key in changed:
                    codes[name] = None
            forgotten += [f"{path}:{key}" for key in sorted(changed)]
            meta_path.write_text(json.dumps(meta, indent=4))
        known[path] = texts
    mutants.mkdir(exist_ok=True)
    store.write_text(json.dumps(known, indent=1))
    return forgotten


def selected_test_files(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The test files mutmut runs: ``[tool.mutmut] pytest_add_cli_args_test_selection``."""
    with pyproject.open("rb") as f:
        selection = tomllib.load(f)["tool"]["mutmut"]["pytest_add_cli_args_test_selection"]
    return [str(s) for s in selection if str(s).endswith(".py")]


def forget_edited_tests(files: list[str], root: Path = ROOT, mutants: Path = MUTANTS) -> list[str]:
    """Have mutmut map again the tests of every test file edited since the last run; those files.

    mutmut learns which functions each test calls once, when it first sees the test
    (``mutants/mutmut-stats.json``): a test edited since to call a function it did not is
    never run against that function's mutants, which then survive. The edited files'
    tests are dropped from the stats, so mutmut takes them for new tests and maps them.
    """
    store, stats_path = mutants / TEXTS, mutants / "mutmut-stats.json"
    known: dict[str, dict[str, str]] = json.loads(store.read_text()) if store.exists() else {}
    before = known.get("tests", {})
    now = {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:12] for f in files}
    edited = sorted(f for f in files if f in before and before[f] != now[f])
    if edited and stats_path.exists():
        stats = json.loads(stats_path.read_text())

        def gone(test: str) -> bool:
            return test.split("::")[0] in edited

        stats["duration_by_test"] = {
            t: d for t, d in stats["duration_by_test"].items() if not gone(t)
        }
        stats["tests_by_mangled_function_name"] = {
            f: [t for t in tests if not gone(t)]
            for f, tests in stats["tests_by_mangled_function_name"].items()
        }
        stats_path.write_text(json.dumps(stats, indent=4))
    known["tests"] = now
    mutants.mkdir(exist_ok=True)
    store.write_text(json.dumps(known, indent=1))
    return edited


def refresh_copies(
    mutated: list[str], sources: list[str], root: Path = ROOT, mutants: Path = MUTANTS
) -> list[str]:
    """Bring mutmut's plain copies of the modules not mutated up to date; those copied.

    mutmut copies the source tree into ``mutants/`` only where a file is missing there, so
    an edit to a module it does not mutate (one the mutated ones import, testkit/) would
    leave the tests running against its old copy.
    """
    copied: list[str] = []
    for top in sources:
        for copy in sorted((mutants / top).rglob("*")):
            rel = copy.relative_to(mutants).as_posix()
            source = root / rel
            plain = rel not in mutated and "__pycache__" not in rel and copy.is_file()
            plain = plain and source.is_file()
            if plain and copy.read_bytes() != source.read_bytes():
                shutil.copy2(source, copy)
                copied.append(rel)
    return copied


def whole_percent(all_scores: list[Score]) -> float:
    """Detected mutants of every module, as a percentage of all."""
    total = sum(s.total for s in all_scores)
    return 100.0 * sum(s.detected for s in all_scores) / total if total else 100.0


class _Item(Protocol):
    @property
    def nodeid(self) -> str: ...


_T = TypeVar("_T", bound=_Item)


def kill_order(items: list[_T], mutant: str | None = None) -> None:
    """Under mutmut (``MUTANT_UNDER_TEST`` names a mutant), sort ``items`` so that the
    tests of the mutant's module's own test file run first, then the quickest (mutmut's
    recorded durations): a mutant is killed at its first failure. Otherwise unchanged."""
    mutant = os.environ.get("MUTANT_UNDER_TEST", "") if mutant is None else mutant
    if "__mutmut_" not in mutant:  # the stats, clean and forced-fail runs, or no mutmut
        return
    module = re.split(r"\.x[_\u01c1]", mutant, maxsplit=1)[0].rpartition(".")[2]
    own = f"test_{module}.py"
    try:  # mutmut runs the tests in mutants/, next to its stats
        durations = json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        durations = {}
    items.sort(
        key=lambda item: (
            item.nodeid.split("::")[0].rpartition("/")[2] != own,
            durations.get(item.nodeid, 0.0),
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Run mutmut over the core rules and print the scores; 1 if below the aim."""
    parser = argparse.ArgumentParser(
        prog="python -m testkit.mutation", description=__doc__.split("\n\n")[0] if __doc__ else ""
    )
    parser.add_argument("--aim", type=float, default=90.0, help="least score, %% (default 90)")
    parser.add_argument("--fresh", action="store_true", help="forget earlier results first")
    parser.add_argument(
        "--report-only", action="store_true", help="print the last run's scores, run nothing"
    )
    parser.add_argument(
        "--recheck",
        action="store_true",
        help="test again only the mutants not killed last time (after tests were added)",
    )
    parser.add_argument("--jobs", type=int, help="mutants tested at once (default: the CPUs)")
    parser.add_argument(
        "only", nargs="*", metavar="MODULE", help="test only these of only_mutate (paths)"
    )
    args = parser.parse_args(argv)
    unknown = set(args.only) - set(modules())
    if unknown:
        parser.error(f"not in [tool.mutmut] only_mutate: {', '.join(sorted(unknown))}")
    if not args.report_only:
        if args.fresh:
            shutil.rmtree(MUTANTS, ignore_errors=True)
        for changed in forget_recommented(modules()):
            print(f"comments changed, tested again: {changed}", file=sys.stderr)
        refresh_copies(modules(), source_paths())
        for edited in forget_edited_tests(selected_test_files()):
            print(f"tests edited, mapped again: {edited}", file=sys.stderr)
        jobs = ["--max-children", str(args.jobs)] if args.jobs else []
        if args.only:
            names = to_test(args.only, args.recheck)
        else:
            names = [n for s in scores(modules()) for n, _ in s.undetected] if args.recheck else []
        if names or not (args.recheck or args.only):  # no names: what mutmut has not run
            run = [sys.executable, "-m", "mutmut", "run", *jobs, *names]
            done = subprocess.run(run, cwd=ROOT, check=False)
            if done.returncode != 0:
                print(f"mutmut run failed (exit {done.returncode})", file=sys.stderr)
                return done.returncode
    all_scores = scores(modules())
    print(report(all_scores))
    return 0 if whole_percent(all_scores) >= args.aim else 1


if __name__ == "__main__":
    sys.exit(main())
