"""The process's descriptors: whether one is free now, asked of a process that has none."""

from __future__ import annotations

from testkit.processes import run_without_descriptors


def test_none_free_is_true_only_while_the_process_has_no_descriptor_left() -> None:
    run = run_without_descriptors(
        "from netplumb.descriptors import none_free\nbefore = none_free()",
        "print(before, errno, none_free(), end=' ')\nos.close(held.pop())\nprint(none_free())",
    )
    assert run.returncode == 0, run.stderr
    before, errno_, full, freed = run.stdout.split()
    assert (before, full, freed) == ("False", "True", "False")
    assert errno_ == "24"  # EMFILE: the process's own limit
