"""Issue 45 item 9: overfitting on tiny subsets (the corpus' ``tiny_subset``: one or two batches trained on,
validation every 20 steps).

- A mixture of experts whose validation loss falls steeply for 100 steps, then turns: raised by the second
  evaluation after the turn. Before, the evaluations' noise was read from every successive change, the early
  descent's big steps included, so the margin a rise had to clear was ~0.3 on a loss of 0.72: raised 7
  evaluations later (step 279).
- A multi-task network whose validation loss stops improving (flat within 5% for 80+ steps) while the training
  loss falls 2.5x more and ends 3x below it: a model fitting its training data and no longer generalising
  better. Before, only a validation loss that rose above its best counted: missed.
Each has its healthy twin (the full training data), silent.
"""
from __future__ import annotations

from _styles import load
from trackdiag.core.record import read_records


def _evals(run) -> list[int]:
    return [r.step for r in read_records(run.run_dir) if "diag/eval/loss" in r.scalars]


def test_turn_after_a_steep_descent_is_raised_by_the_second_evaluation_after_it(tmp_path) -> None:
    run = load("moe_top1").run(tmp_path, level="advanced", seed=0, steps=180, fault="tiny_subset")
    first = run.first("warning")
    assert first is not None and first.kind == "overfitting", [(a.kind, a.step) for a in run.diag.alerts]
    evals, raised = _evals(run), run.raised_at(first)
    assert first.step in evals and evals.index(raised) - evals.index(first.step) == 1, (first.step, raised, evals)


def test_flat_validation_while_training_keeps_falling_is_overfitting(tmp_path) -> None:
    run = load("multitask").run(tmp_path, level="advanced", seed=0, steps=300, fault="tiny_subset")
    first = run.first("warning")
    assert first is not None and first.kind == "overfitting", [(a.kind, a.step) for a in run.diag.alerts]
    assert "stayed within" in first.message and "train loss fell" in first.message, first.message
    assert first.where == "eval/loss" and run.raised_at(first) <= 300


def test_multitask_on_its_full_data_raises_nothing(tmp_path) -> None:
    run = load("multitask").run(tmp_path, level="advanced", seed=0, steps=300, fault=None)
    assert run.alerts("warning") == [], [(a.kind, a.step, a.message) for a in run.alerts("warning")]
