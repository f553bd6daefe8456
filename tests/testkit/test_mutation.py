"""What ``python -m testkit.mutation MODULE...`` asks mutmut to run, from its results file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit import mutation


def _results(mutants: Path, path: str, codes: dict[str, int | None]) -> None:
    meta = mutants / f"{path}.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": codes}))


def test_a_module_runs_its_untested_mutants_or_on_recheck_every_one_not_killed(
    tmp_path: Path,
) -> None:
    codes = {"a.b.x_f__mutmut_1": 1, "a.b.x_f__mutmut_2": 0, "a.b.x_f__mutmut_3": None}
    _results(tmp_path, "a/b.py", codes)
    assert mutation.to_test(["a/b.py"], recheck=False, mutants=tmp_path) == ["a.b.x_f__mutmut_3"]
    assert mutation.to_test(["a/b.py"], recheck=True, mutants=tmp_path) == [
        "a.b.x_f__mutmut_2",
        "a.b.x_f__mutmut_3",
    ]
    # a module mutmut never generated: every mutant of it, by pattern
    assert mutation.to_test(["a/c.py"], recheck=False, mutants=tmp_path) == ["a.c.*"]


def test_a_module_not_in_only_mutate_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        mutation.main(["--report-only", "workers/nope.py"])
    assert refused.value.code == 2
    assert "not in [tool.mutmut] only_mutate: workers/nope.py" in capsys.readouterr().err


@dataclass
class _Item:
    nodeid: str


def test_a_mutants_own_module_tests_run_first_then_the_quickest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # mutmut's working directory: its stats beside it
    slow, quick = "tests/a/test_other.py::test_slow", "tests/a/test_other.py::test_quick"
    own_slow, own_quick = "tests/w/test_bodies.py::test_x", "tests/w/test_bodies.py::test_y"
    durations = {slow: 9.0, quick: 0.1, own_slow: 5.0, own_quick: 1.0}
    Path("mutmut-stats.json").write_text(json.dumps({"duration_by_test": durations}))
    ids = [slow, own_slow, quick, own_quick]
    for mutant in ("w.bodies.x_f__mutmut_2", "w.bodies.x\u01c1Bodies\u01c1_take__mutmut_7"):
        items = [_Item(i) for i in ids]
        mutation.kill_order(items, mutant)
        assert [i.nodeid for i in items] == [own_quick, own_slow, quick, slow]
    for run in ("", "stats", "fail"):  # not a mutant: the order stays
        items = [_Item(i) for i in ids]
        mutation.kill_order(items, run)
        assert [i.nodeid for i in items] == ids
    Path("mutmut-stats.json").unlink()  # no stats: its own module's first all the same
    items = [_Item(i) for i in ids]
    mutation.kill_order(items, "w.bodies.x_f__mutmut_2")
    assert [i.nodeid for i in items] == [own_slow, own_quick, slow, quick]


def test_a_function_whose_comments_changed_is_tested_again(tmp_path: Path) -> None:
    root, mutants = tmp_path / "src", tmp_path / "mutants"
    (root / "a").mkdir(parents=True)
    source = root / "a" / "b.py"
    source.write_text(
        "def f(x):\n    return x < 1\n\n\nclass C:\n    def g(self):\n        return 2\n"
    )
    codes: dict[str, int | None] = {
        "a.b.x_f__mutmut_1": 1,
        "a.b.x_f__mutmut_2": 0,
        "a.b.x\u01c1C\u01c1g__mutmut_1": 1,
    }
    _results(mutants, "a/b.py", codes)
    assert mutation.forget_recommented(["a/b.py"], root, mutants) == []  # the first: as is
    assert mutation.forget_recommented(["a/b.py"], root, mutants) == []  # nothing changed
    # a pragma on f: mutmut's hash of its code is the same, its mutants are not
    source.write_text(source.read_text().replace("x < 1\n", "x < 1  # pragma: no mutate\n"))
    assert mutation.forget_recommented(["a/b.py"], root, mutants) == ["a/b.py:x_f"]
    meta = json.loads((mutants / "a/b.py.meta").read_text())
    assert meta["exit_code_by_key"] == {
        **codes,
        "a.b.x_f__mutmut_1": None,
        "a.b.x_f__mutmut_2": None,
    }
    assert mutation.forget_recommented(["a/b.py"], root, mutants) == []


def test_a_plain_copy_of_a_module_edited_since_is_brought_up_to_date(tmp_path: Path) -> None:
    root, mutants = tmp_path / "src", tmp_path / "mutants"
    for tree in (root, mutants):
        (tree / "a").mkdir(parents=True)
        (tree / "a" / "same.py").write_text("x = 1\n")
    (root / "a" / "edited.py").write_text("x = 2\n")
    (mutants / "a" / "edited.py").write_text("x = 1\n")
    (root / "a" / "mutated.py").write_text("x = 2\n")
    (mutants / "a" / "mutated.py").write_text("x = 1  # its mutants\n")
    (mutants / "a" / "mutated.py.meta").write_text("{}")  # mutmut's own: no source
    copied = mutation.refresh_copies(["a/mutated.py"], ["a"], root, mutants)
    assert copied == ["a/edited.py"]
    assert (mutants / "a" / "edited.py").read_text() == "x = 2\n"
    assert (mutants / "a" / "mutated.py").read_text() == "x = 1  # its mutants\n"
    assert mutation.refresh_copies(["a/mutated.py"], ["a"], root, mutants) == []


def test_the_tests_of_an_edited_test_file_are_mapped_again(tmp_path: Path) -> None:
    root, mutants = tmp_path / "src", tmp_path / "mutants"
    (root / "tests").mkdir(parents=True)
    mutants.mkdir()
    edited, same = root / "tests" / "test_a.py", root / "tests" / "test_b.py"
    edited.write_text("def test_x(): ...\n")
    same.write_text("def test_y(): ...\n")
    x, y = "tests/test_a.py::test_x", "tests/test_b.py::test_y"
    stats = {
        "duration_by_test": {x: 1.0, y: 2.0},
        "tests_by_mangled_function_name": {"m.x_f": [x, y]},
    }
    (mutants / "mutmut-stats.json").write_text(json.dumps(stats))
    files = ["tests/test_a.py", "tests/test_b.py"]
    assert mutation.forget_edited_tests(files, root, mutants) == []  # the first: as is
    edited.write_text("def test_x(): assert f()\n")
    assert mutation.forget_edited_tests(files, root, mutants) == ["tests/test_a.py"]
    kept = json.loads((mutants / "mutmut-stats.json").read_text())
    assert kept["duration_by_test"] == {y: 2.0}  # mutmut takes test_x for a new test
    assert kept["tests_by_mangled_function_name"] == {"m.x_f": [y]}
    assert mutation.forget_edited_tests(files, root, mutants) == []
