"""The suite's own schedule (conftest.py): the costliest tests are collected first, so that pytest-xdist
(``--dist loadgroup --no-loadscope-reorder``) starts them first and no worker is left with a long test at the
end; every entry of ``COSTLY`` still names a collected test (a renamed test would silently lose its place).
Both read this session's collection: they skip when the whole suite was not collected
(``pytest tests -k suite_order`` collects it and runs these two)."""
from __future__ import annotations

import pytest

from conftest import COLLECTED, COSTLY, SCHEDULED, cost, group_of


def module(nodeid: str) -> str:
    """The test module's name of a node id (``tests/test_x.py::test_y[...]@group`` -> ``test_x``)."""
    return nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")


def _whole_suite() -> list[str]:
    """This session's collection (before ``-k`` deselected anything): ``pytest tests -k suite_order`` checks it."""
    ids = list(COLLECTED)
    if not any(i.startswith("tests/test_sweep_server.py") for i in ids) or len(ids) < 500:
        pytest.skip("the whole suite was not collected (pytest tests -k suite_order)")
    return ids


def test_every_costly_entry_names_a_collected_test() -> None:
    ids = _whole_suite()
    stale = [key for key in COSTLY if not any(i.startswith(key) for i in ids)]
    assert not stale, f"conftest.COSTLY names tests that no longer exist: {stale}"


def test_the_costliest_scopes_come_first() -> None:
    ids = _whole_suite()
    scopes: list[str] = []  # xdist's work units in collection order: a group is one, any other test is one
    for nodeid in ids:
        scope = group_of(module(nodeid)) or nodeid
        if not scopes or scopes[-1] != scope:
            assert scope not in scopes, f"{scope}: a group's tests are split in the collection"
            scopes.append(scope)
    costs = [max(cost(i) for i in ids if (group_of(module(i)) or i) == s) for s in scopes]
    assert costs == sorted(costs, reverse=True), list(zip(scopes, costs))[:40]
    assert costs[0] >= 100 and costs[-1] == 0


def test_grouped_modules_reach_xdist_as_one_group(request: pytest.FixtureRequest) -> None:
    """Each test of a grouped module (:func:`conftest.group_of`) reaches xdist's scheduler as ``id@group`` (one work
    unit, one worker, its costly module fixtures started once). The grouping was silently a no-op while conftest's
    hook ran after xdist's, which reads the groups into the ids: the browser story trained on all three workers."""
    if not getattr(request.config.option, "loadgroup", False) or not SCHEDULED:  # xdist sets it on its workers
        pytest.skip("not an xdist worker under --dist loadgroup")
    grouped = [i for i in SCHEDULED if group_of(module(i))]
    if not grouped:
        pytest.skip("no grouped module collected")
    ungrouped = [i for i in grouped if not i.endswith(f"@{group_of(module(i))}")]
    assert not ungrouped, f"{len(ungrouped)} of {len(grouped)} grouped tests reach xdist without their group: {ungrouped[:3]}"
