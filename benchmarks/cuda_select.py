"""pytest plugin for scripts/gpu_check.sh: marks as ``cuda`` every test that needs a CUDA device, so
``pytest -p cuda_select -m cuda`` runs them all (with ``benchmarks/`` on ``sys.path``).

A test needs CUDA when it carries ``@pytest.mark.cuda`` or a ``skipif`` whose reason names CUDA or a
GPU (the suite's convention: ``skipif(not torch.cuda.is_available(), reason="needs a CUDA device")``).
Tests that skip *because* CUDA is present ("checks the CPU path") are not selected.
"""
from __future__ import annotations

import re

import pytest

_NEEDS = re.compile(r"\b(cuda|gpu)\b", re.IGNORECASE)


def needs_cuda(item: pytest.Item) -> bool:
    if item.get_closest_marker("cuda") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if _NEEDS.search(reason) and "cpu path" not in reason.lower():
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skips without one); scripts/gpu_check.sh runs them all")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if needs_cuda(item) and item.get_closest_marker("cuda") is None:
            item.add_marker(pytest.mark.cuda)
