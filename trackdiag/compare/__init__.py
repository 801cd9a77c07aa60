"""Sweep-level anomaly comparison: which runs of a sweep broke, how, when, and which settings did it.

>>> from trackdiag.compare import compare, write_outputs
>>> c = compare("multirun/2025-01-01/12-00-00")      # or "mlflow:my-exp", "wandb:me/proj/group"
>>> print(c.headline); print("\\n".join(c.risk_lines))
>>> write_outputs(c, "report/")                       # comparison.{csv,json,html} + plots

Heavy dependencies (mlflow, wandb, matplotlib, rich) are imported only by the parts that need them.
"""
from trackdiag.compare.comparison import Comparison, compare, load_runs
from trackdiag.compare.outputs import write_outputs
from trackdiag.compare.runs import CompareError, RunSummary

__all__ = ["Comparison", "CompareError", "RunSummary", "compare", "load_runs", "write_outputs"]
