"""A test whose need the machine lacks skips on a developer's machine and fails in CI."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import pytest

from tests import requirements
from tests.requirements import CC, NETNS, POSTGRES, needs, unmet


@pytest.fixture
def no_requirement(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for need in requirements.NEEDS:
        monkeypatch.delenv(f"CORRAL_REQUIRE_{need}", raising=False)
    monkeypatch.delenv("CI", raising=False)
    return monkeypatch


def test_an_unmet_need_skips_where_nothing_requires_it(no_requirement: pytest.MonkeyPatch) -> None:
    with pytest.raises(pytest.skip.Exception, match="no C compiler"):
        unmet(CC, "no C compiler")


@pytest.mark.parametrize("value", ["true", "1", "yes", "TRUE"])
def test_ci_requires_every_need(no_requirement: pytest.MonkeyPatch, value: str) -> None:
    no_requirement.setenv("CI", value)
    for need in requirements.NEEDS:
        with pytest.raises(pytest.fail.Exception, match=f"no {need}, but CI is set"):
            unmet(need, f"no {need}")


def test_one_variable_requires_one_need(no_requirement: pytest.MonkeyPatch) -> None:
    no_requirement.setenv("CORRAL_REQUIRE_NETNS", "1")
    with pytest.raises(pytest.fail.Exception, match="CORRAL_REQUIRE_NETNS is set"):
        unmet(NETNS, "no network namespaces here")
    with pytest.raises(pytest.skip.Exception):
        unmet(POSTGRES, "no PostgreSQL")  # not required by that variable


def test_ci_false_requires_nothing(no_requirement: pytest.MonkeyPatch) -> None:
    no_requirement.setenv("CI", "false")
    assert requirements.required_by(NETNS) is None


def test_an_unknown_need_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown need 'GPU'"):
        requirements.required_by("GPU")


class _Item:
    """What requirements.check reads of a pytest item: its marks."""

    def __init__(self, *marks: pytest.MarkDecorator) -> None:
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name: str) -> Iterator[pytest.Mark]:
        return (m for m in self.marks if m.name == name)


def test_the_needs_mark_skips_or_fails_only_for_an_unmet_need(
    no_requirement: pytest.MonkeyPatch,
) -> None:
    met, lacking = needs(NETNS, None), needs(NETNS, "no ip here")
    requirements.check(cast(pytest.Item, _Item(met)))  # nothing happens
    with pytest.raises(pytest.skip.Exception, match="no ip here"):
        requirements.check(cast(pytest.Item, _Item(met, lacking)))
    no_requirement.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no ip here, but CI is set"):
        requirements.check(cast(pytest.Item, _Item(lacking)))
