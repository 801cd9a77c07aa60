"""The example app reads scikit-learn's digits without importing scikit-learn: the same arrays as load_digits."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

import _warm as warm

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def test_the_example_reads_the_digits_sklearn_loads():
    from sklearn.datasets import load_digits as sklearn_digits

    spec = importlib.util.spec_from_file_location("example_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x, y = module.load_digits()
    want_x, want_y = sklearn_digits(return_X_y=True)
    assert x.shape == (1797, 64) and np.array_equal(x, want_x)
    assert np.array_equal(y, want_y) and sorted(set(y.tolist())) == list(range(10))


def test_the_example_app_imports_no_sklearn():
    import subprocess

    code = (f"import runpy, sys; sys.argv = ['x']; m = runpy.run_path({str(EXAMPLE)!r}, run_name='not_main'); "
            "m['load_data'](0); print('sklearn' in sys.modules)")
    out = warm.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr
