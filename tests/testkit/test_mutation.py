"""What ``python -m testkit.mutation MODULE...`` asks mutmut to run, from its results file."""

from __future__ import annotations

import json
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
