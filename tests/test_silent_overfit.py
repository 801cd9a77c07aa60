"""Issue 45 item 9: overfitting on tiny subsets (the corpus' ``tiny_subset``: one or two batches trained on,
validation every 20 steps).

- A mixture of experts whose validation loss falls steeply for 100 steps, then turns: raised by the second
  evaluation after the turn. Before, the evaluations' noise was read from every successive change, the early
  descent's big steps included, so the margin a rise had to clear was ~0.3 on a loss of 0.72: raised 7
  evaluations later (step 279).
- A multi-task network whose validation loss stops improving (flat within 5% for 80+ steps) while the training
  loss falls 2.5x more and ends 3x below it: a model fitting its training data and no longer generalising
  better. Before, only a validation loss that rose above its best counted: missed.
- A regression whose validation loss turns slowly (+5 %, then +3.5 % and +3.9 % an evaluation) while its train
  loss falls 10x in 100 steps: raised by the second evaluation after the turn (the ``climb`` path). Before, the
  trend path waited for two readings 5 % above the smoothed best and for the validation loss to exceed the
  train loss's 50-step EMA, which lagged the fast fall (5,160 at step 99 against ~2,200): raised at step 159,
  four evaluations after the turn.
- A healthy validation loss on a small, noisy evaluation set (+-8 % a reading, levelled off while the train loss
  keeps falling), with climbs of two evaluations in a row that clear 5 % of its best, stays silent (40 seeds).
  Before, a rise had to clear 1.5x the successive changes above the lowest smoothed reading, which the noise of a
  long plateau does: raised in 3 of 40; now 3x the scatter around a smooth curve (second differences: a steady
  rise is not scatter, so real turns keep their margin), 4x for the climb.
Each has its healthy twin (the full training data), silent.
"""
from __future__ import annotations

import random

from _styles import load
from trackdiag.core.record import Record, read_records
from trackdiag.rules.generalization import Overfitting


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


def _turn(run) -> tuple[list[int], int]:
    """The run's evaluation steps and the index of its turn: the first evaluation after the lowest validation loss."""
    evals = [(r.step, r.scalars["diag/eval/loss"]) for r in read_records(run.run_dir) if "diag/eval/loss" in r.scalars]
    return [s for s, _ in evals], 1 + min(range(len(evals)), key=lambda i: evals[i][1])


def test_a_slow_turn_under_a_fast_falling_train_loss_is_raised_by_the_second_evaluation_after_it(tmp_path) -> None:
    run = load("regression_mse").run(tmp_path, level="advanced", seed=0, steps=140, fault="tiny_subset")
    evals, turn = _turn(run)
    first = run.first("warning")
    assert first is not None and first.kind == "overfitting", [(a.kind, a.step) for a in run.diag.alerts]
    assert first.step == evals[turn] and run.raised_at(first) <= evals[turn + 2], (first.step, run.raised_at(first), evals)
    assert "rose from its best" in first.message, first.message


def _judge(vals: list[float], train: list[float], **kw: float) -> list[tuple[int, int]]:
    """Overfitting over evaluations every 20 steps, the train loss logged every 10 steps with its every-step series."""
    rule, history, out = Overfitting(**kw), [], []
    for i, (v, t) in enumerate(zip(vals, train)):
        for step in (i * 20 + 10, i * 20 + 19):
            history.append(Record(step=step, scalars={"diag/loss/ema": t * 1.1},
                                  series={"diag/loss": [(s, t) for s in range(step - 9, step + 1)]}))
        out += [(a.step, i * 20 + 19) for a in rule.check_eval(Record(step=i * 20 + 19, scalars={"diag/eval/loss": v}), history)]
    return out


def test_a_noisy_validation_loss_that_climbs_within_its_scatter_is_not_overfitting() -> None:
    train = [1.9 * 0.9 ** i + 0.42 for i in range(30)]  # keeps falling, ends ~0.45: val/train ~1.3
    fired, climbing = {}, 0
    for seed in range(40):
        gen = random.Random(seed)  # falls, then levels off at ~0.6 on a small evaluation set: +-8 % a reading
        vals = [(2.0 * 0.8 ** i + 0.6) * (1 + 0.08 * gen.uniform(-1, 1)) for i in range(30)]
        climbing += any(vals[i - 2] < vals[i - 1] < vals[i] and vals[i] > 1.05 * min(vals[:i]) for i in range(12, 30))
        if found := _judge(vals, train):
            fired[seed] = found
    assert climbing >= 20, climbing  # most of them climb two evaluations in a row to 5 % above their best
    assert fired == {}, fired  # before: 3 of 40 raised (seeds 0, 37, 39), the best's plateau cleared by 1.5x the noise
    # the last readings with the scatter ignored are raised: the noise guard is what keeps them silent
    assert _judge(vals, train, rise_noise=0.0, climb_noise=0.0) != []


def _sgdr(out, seed: int, n_train: int, t0: int):
    """SGD + CosineAnnealingWarmRestarts on a linear-teacher task, validation every 10 steps."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import trackdiag
    from _zoo_a import one_thread

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(13)
    teacher = torch.randn(16, 4, generator=gen)
    x, xv = torch.randn(n_train, 16, generator=gen), torch.randn(256, 16, generator=gen)
    y, yv = (x @ teacher).argmax(1), (xv @ teacher).argmax(1)
    if n_train < 256:
        y = torch.randint(0, 4, (n_train,), generator=gen)  # a small set with its own labels: memorised, not learned
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=t0)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(out),
                                             probes={"report": {"enabled": False}}) as diag:
        for step in range(300):
            i = torch.randint(0, n_train, (32,), generator=gen)
            loss = F.cross_entropy(model(x[i]), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            diag.step(loss, batch=(x[i], y[i]))
            if step % 10 == 9:
                with torch.no_grad():
                    diag.log_eval(loss=float(F.cross_entropy(model(xv), yv)))
    return diag


def test_warm_restarts_are_not_overfitting(tmp_path) -> None:
    """SGDR every 60 steps: each restart sends both losses up by design and the validation loss wanders while the
    rate is high. Before: ``overfitting`` at the restart after the third cycle's best in 3 of 6 seeds (seed 3: step
    189). A warm restart (the rate rising 2x+ after falling to half its high) now starts the series again, judged
    60 steps after it."""
    for seed in (3, 5):
        diag = _sgdr(tmp_path / str(seed), seed, 1024, 60)
        assert [a for a in diag.alerts if a.kind == "overfitting"] == [], [(a.step, a.message) for a in diag.alerts]


def test_memorising_under_warm_restarts_is_still_said(tmp_path) -> None:
    """The same schedule with 150-step cycles on 64 randomly labelled points: memorised in the first cycle, raised
    before its restart."""
    diag = _sgdr(tmp_path, 0, 64, 150)
    found = [a for a in diag.alerts if a.kind == "overfitting"]
    assert found and found[0].step < 150, [(a.kind, a.step) for a in diag.alerts]


def test_the_best_quoted_is_said_to_be_smoothed_and_the_lowest_reading_given() -> None:
    """The rule reads each evaluation as the median of it and its neighbours (one lucky reading is no best): its message
    quoted that smoothed best alone, which a user checking the chart could not find (the rehearsal's prototypical
    network: "best 0.641" against a lowest logged value of 0.613). It now gives both."""
    vals = [2.0, 1.4, 1.0, 0.8, 0.7, 0.66, 0.64, 0.55, 0.65, 0.66, 0.75, 0.85, 0.95, 1.05, 1.15]
    train = [1.9 * 0.85 ** i + 0.05 for i in range(len(vals))]
    rule, history, found = Overfitting(), [], []
    for i, (v, t) in enumerate(zip(vals, train)):
        for step in (i * 20 + 10, i * 20 + 19):
            history.append(Record(step=step, scalars={"diag/loss/ema": t * 1.1},
                                  series={"diag/loss": [(s, t) for s in range(step - 9, step + 1)]}))
        found += rule.check_eval(Record(step=i * 20 + 19, scalars={"diag/eval/loss": v}), history)
    assert found, "the rise after the best is overfitting"
    message = found[0].message
    assert "the lowest single reading 0.55)" in message, message
    assert "its best 0.64 (" in message or "its best 0.65 (" in message, message
