"""The cost budget (trackdiag/session/budget_policy.py): what it decides from measured windows, how the session sheds
(the logging cadence, extreme's per-step extras), that a NaN is still logged at the preset's cadence and
named, and that ``budget=null`` keeps the preset's cadence. The session tests force the decision with a
budget no run can meet (1e-9): which windows are measured is timing, what is shed then is not."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import trackdiag
from trackdiag.session.budget_policy import WALL, Budget, share_of
from trackdiag.core.errors import ConfigError
from trackdiag.sinks.console import format_summary
from trackdiag.core.record import read_records
from _clip import clip_checked

TINY = 1e-9


def test_budget_decides_from_the_median_after_warmup():
    b = Budget(0.09, ["every x2", "every x5"], warmup=100, windows=5)
    # 10% own time per window, x WALL (1.25) = 12.5% > 9%: but not before step 100 (warmup=100 here)
    for step in range(10, 100, 10):
        assert b.window(step, own=0.010, wall=0.110) is None
    assert b.window(100, own=0.010, wall=0.110) == "every x2"
    assert b.taken[0]["step"] == 100 and b.taken[0]["measured"] == pytest.approx(WALL * 0.1, rel=1e-3)
    # measured again from scratch: 4 windows are not enough
    for step in (120, 140, 160, 180):
        assert b.window(step, own=0.010, wall=0.110) is None
    assert b.window(200, own=0.010, wall=0.110) == "every x5"
    for step in range(250, 600, 50):
        assert b.window(step, own=0.010, wall=0.110) is None  # nothing left to shed
    assert b.over()


def test_the_logging_steps_own_time_is_not_scaled_as_per_step_time_is():
    """WALL scales the per-step part (hooks and step() between the user's operations); a window whose own time is
    all its logging step (a large model's per-layer statistics) is judged at its own time."""
    per_step, logging = Budget(0.09, ["every x2"], warmup=0, windows=1), Budget(0.09, ["every x2"], warmup=0, windows=1)
    assert per_step.window(10, own=0.008, wall=0.108) == "every x2"  # 8% x 1.4 = 11.2% > 9%
    assert per_step.last == pytest.approx(WALL * 0.08)
    assert logging.window(10, own=0.008, wall=0.108, logging=0.008) is None  # 8% as measured
    assert logging.last == pytest.approx(0.08)


@pytest.mark.parametrize("own,first", [(0.10, "every x2"), (0.13, "extras")])
def test_extremes_extras_are_shed_on_the_clocks_own_evidence_only(own: float, first: str):
    """Its extras are a capability (the exact-step replay, per-module flags), not a cadence: shed when the own time
    itself is over (13% > 12%), not on WALL's estimate alone (10% x 1.5 = 15%: the cadence goes instead)."""
    b = Budget(0.12, ["extras", "every x2", "every x5"], warmup=0, windows=1)
    assert b.window(10, own=own, wall=1.0 + own) == first
    assert "extras" not in b.sheds


def test_one_expensive_window_is_not_a_trend():
    """A histogram step or a GC pause makes one window expensive: the median of five ignores it."""
    b = Budget(0.09, ["every x2"], warmup=0, windows=5)
    got = [b.window(s, own=own, wall=0.1 + own) for s, own in zip(range(10, 60, 10), (0.002, 0.002, 0.05, 0.002, 0.002))]
    assert got == [None] * 5 and b.last == pytest.approx(WALL * 0.02) and not b.taken
    assert not b.over()


def test_share_of_settings():
    assert share_of("auto", "basic") == 0.06 and share_of("auto", "advanced") == 0.09 and share_of("auto", "extreme") == 0.12
    assert share_of(None, "advanced") is None and share_of(False, "advanced") is None
    assert share_of(0.2, "basic") == 0.2


def test_bad_budget_is_one_config_error_with_the_other_problems():
    with pytest.raises(ConfigError) as err:
        trackdiag.Diagnostics(nn.Linear(2, 2), level="advanced", sinks=["local"], budget="lots", every=0)
    text = str(err.value)
    assert "diag.budget" in text and "'lots'" in text and "diag.every" in text
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ConfigError, match="diag.budget"):
            trackdiag.Diagnostics(nn.Linear(2, 2), level="advanced", sinks=["local"], budget=bad)


class Boom(nn.Module):
    """Finite on ordinary inputs; NaN where its input is huge: a fault a replay of the step's forward
    reproduces on any weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x.abs() > 1e3, float("nan"))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Boom(), nn.Tanh(), nn.Linear(16, 3))


def _train(tmp_path, level: str, budget, steps: int, nan_at: int = -1, batch: bool = True, after_capture: int = 0):
    """A tiny classifier (learnable labels); at ``nan_at`` one huge input, which module 1 (Boom) turns into NaN.
    ``batch``: the loop passes ``step(outputs=..., batch=...)`` (else the loss alone). ``after_capture``: the NaN
    comes that many steps after the budget shed the replay's capture instead (when is timing: a window the busy
    machine's clock makes unusable is not judged, and the shed comes a window later).
    Returns the session and, per step, how many alerts had been raised after it."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 3, generator=g)
    raised = []
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path / level),
                                 budget=budget, probes={"report": {"enabled": False}, "landscape": {"enabled": False}})
    with diag:
        for step in range(steps):
            x = torch.randn(16, 8, generator=g)
            y = (x @ w).argmax(1)
            if step == nan_at:
                x[0] = 1e6
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if batch:
                diag.step(loss, outputs=out, batch=(x, y))
            else:
                diag.step(loss)
            raised.append(len(diag.alerts))
            if after_capture and nan_at < 0 and not next(p for p in diag.probes if p.name == "nan_replay").capturing:
                nan_at = step + after_capture
    diag.nan_at = nan_at
    return diag, raised


def test_shedding_stretches_the_logging_cadence(tmp_path):
    diag, _ = _train(tmp_path, "advanced", TINY, 520)
    shed = diag.summary()["budget"]["shed"]
    assert [s["shed"] for s in shed] == ["every x2", "every x5"]
    first, second = shed[0]["step"], shed[1]["step"]
    steps = [r.step for r in read_records(tmp_path / "advanced")]
    after = [s for s in steps if first < s <= second]
    assert after and all(s % 20 == 0 for s in after), after
    late = [s for s in steps if second < s < 519]  # the last one: close()'s final window
    assert late and all(s % 50 == 0 for s in late), late
    assert all(s < 10 or s % 10 == 0 for s in steps if s < first)  # the first 10 steps each, as the preset says
    assert not [a for a in diag.alerts if a.severity != "info"]  # a healthy run stays silent


def test_the_window_checks_stacks_are_the_logging_steps_series_every_step_once(tmp_path):
    """Under a stretched cadence the window checks between logging steps stack the losses and gradient norms they
    read, and the logging step reuses those chunks: the full-resolution series still hold every step once, in order,
    equal to the loop's own loss and to ``clip_grad_norm_``'s return value (max_norm=inf: it measures only)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 3, generator=g)
    losses, norms = [], []
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], output_dir=str(tmp_path / "b"),
                                 budget=TINY, probes={"report": {"enabled": False}})
    with diag:
        for step in range(700):
            x = torch.randn(16, 8, generator=g)
            loss = nn.functional.cross_entropy(model(x), (x @ w).argmax(1))
            opt.zero_grad()
            loss.backward()
            norms.append(float(clip_checked(model.parameters(), float("inf"))))
            opt.step()
            losses.append(float(loss))
            diag.step(loss)
    assert [s["shed"] for s in diag.summary()["budget"]["shed"]][:1] == ["every x2"]
    records = list(read_records(tmp_path / "b"))
    logged = [r.step for r in records]
    assert any(b - a > 50 for a, b in zip(logged, logged[1:])), logged  # stretched: window checks in between
    for key, want in (("diag/loss", losses), ("diag/grad/global_norm", norms)):
        points = [p for r in records for p in r.series.get(key, [])]
        assert [s for s, _ in points] == list(range(700)), key
        assert [v for _, v in points] == pytest.approx(want, rel=1e-5), key


def test_no_budget_keeps_the_cadence(tmp_path):
    diag, _ = _train(tmp_path, "advanced", None, 360)
    assert diag.summary()["budget"] is None
    steps = [r.step for r in read_records(tmp_path / "advanced")]
    assert [s for s in steps if s >= 300][:6] == [300, 310, 320, 330, 340, 350]


def test_nan_under_a_stretched_cadence_is_still_logged_within_the_presets_cadence(tmp_path):
    """Logging every 50 steps by then; the NaN at step 463 is found by the every-10 check at step 470,
    raised there and named (module 1, by the replay)."""
    diag, raised = _train(tmp_path, "advanced", TINY, 500, nan_at=463)
    assert [s["shed"] for s in diag.summary()["budget"]["shed"]] == ["every x2", "every x5"]
    bad = [a for a in diag.alerts if a.kind.startswith("nonfinite")]
    assert bad, [(a.kind, a.step) for a in diag.alerts]
    assert min(a.step for a in bad) == 463
    first_raised = next(i for i, n in enumerate(raised) if n > 0 and any(a.kind.startswith("nonfinite") for a in diag.alerts[:n]))
    assert first_raised == 470
    assert any(a.where.startswith("1 (Boom") for a in bad), [(a.kind, a.where) for a in bad]


def test_extreme_sheds_its_per_step_extras_first(tmp_path):
    diag, _ = _train(tmp_path, "extreme", TINY, 330)
    shed = diag.summary()["budget"]["shed"]
    assert shed[0]["shed"] == "extras"
    flight = next(p for p in diag.probes if p.name == "flight")
    replay = next(p for p in diag.probes if p.name == "nan_replay")
    assert flight.flags is None and replay.mode == "log" and replay.snapshot_bytes > 0
    text = format_summary(diag.summary())
    # from the first decision (step 300) on a quiet machine; a window a busy machine's clock makes unusable is not
    # judged, and the shed comes a window later (310 in a full 2-core run)
    assert shed[0]["step"] % 10 == 0 and 300 <= shed[0]["step"] < 330, shed
    assert f"cost budget from step {shed[0]['step']}: per-module output flags" in text


def test_extreme_after_shedding_still_names_the_nan(tmp_path):
    diag, _ = _train(tmp_path, "extreme", TINY, 380, nan_at=357)
    assert diag.summary()["budget"]["shed"][0]["shed"] == "extras"
    bad = [a for a in diag.alerts if a.kind.startswith("nonfinite")]
    assert bad and min(a.step for a in bad) == 357
    assert any(a.where.startswith("1 (Boom") for a in bad), [(a.kind, a.where) for a in bad]


def test_a_loss_spike_under_a_stretched_cadence_is_raised_within_the_presets_cadence(tmp_path):
    """Logging every 50 steps by then; the loss x1000 at step 463 only (labels scaled: a bad batch the
    model recovers from) is a jump the every-10 check sees at step 470: the rules judge it there."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 3, generator=g)
    raised_at = None
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path / "a"),
                                 budget=TINY, probes={"report": {"enabled": False}})
    with diag:
        for step in range(500):
            x = torch.randn(16, 8, generator=g)
            y = (x @ w).argmax(1)
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            logged = loss * 1000 if step == 463 else loss  # what the loop reports (a bad batch's loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(logged)
            if raised_at is None and any(a.kind == "loss_spike" for a in diag.alerts):
                raised_at = step
    assert [s["shed"] for s in diag.summary()["budget"]["shed"]] == ["every x2", "every x5"]
    spikes = [a for a in diag.alerts if a.kind == "loss_spike"]
    assert spikes and spikes[0].step == 463
    assert raised_at == 470


def _shed_capture_then_nan(tmp_path, batch: bool):
    """Sheds every 2x (step 300), 5x (400), then the replay's capture (650 on a quiet machine); a NaN 23 steps
    after that, checked by the every-10 check 7 steps later."""
    diag, raised = _train(tmp_path, "advanced", TINY, 850, batch=batch, after_capture=23)
    shed = diag.summary()["budget"]["shed"]
    assert [s["shed"] for s in shed] == ["every x2", "every x5", "capture"], shed
    nan_at = diag.nan_at
    assert nan_at == shed[2]["step"] + 23 and shed[2]["step"] % 50 == 0, (nan_at, shed)
    replay = next(p for p in diag.probes if p.name == "nan_replay")
    assert replay.shed_at == shed[2]["step"] and not replay.capturing
    for comp in diag.components:  # the call slot is given back: the model's own fast call path
        assert "_compiled_call_impl" not in comp.model.__dict__
    bad = [a for a in diag.alerts if a.kind.startswith("nonfinite")]
    assert bad and min(a.step for a in bad) == nan_at, [(a.kind, a.step) for a in diag.alerts]
    first_raised = next(i for i, n in enumerate(raised) if n and any(a.kind.startswith("nonfinite") for a in diag.alerts[:n]))
    assert first_raised == nan_at + 7
    return bad


def test_after_the_capture_is_shed_a_step_with_its_batch_is_still_named(tmp_path):
    bad = _shed_capture_then_nan(tmp_path, batch=True)
    assert any(a.where.startswith("1 (Boom") for a in bad), [(a.kind, a.where) for a in bad]


def test_after_the_capture_is_shed_a_step_without_its_batch_says_why_it_is_not_named(tmp_path):
    bad = _shed_capture_then_nan(tmp_path, batch=False)
    assert not any("Boom" in a.where for a in bad)
    assert any("cost budget stopped keeping the training forwards" in a.message for a in bad), [a.message for a in bad]


def test_the_summary_says_what_a_run_costs_after_its_sheds():
    """The run's overhead figure averages its start (full cadence) in; after a shed the summary also gives the
    latest estimate, and no estimate when still over (it says what to do instead)."""
    from trackdiag.sinks.console import budget_lines

    shed = [{"step": 300, "shed": "every x2", "what": "logging every 20 steps instead of 10"}]
    lines = budget_lines({"budget": {"share": 0.09, "shed": shed, "over": False, "measured": 0.0612}})
    assert lines[-1].startswith("  since then ~6.1% of each step")
    over = budget_lines({"budget": {"share": 0.09, "shed": shed, "over": True, "measured": 0.2}})
    assert "still above" in over[-1] and not any("since then" in line for line in over)
    assert budget_lines({"budget": {"share": 0.09, "shed": [], "over": False, "measured": 0.05}}) == []


def _windows(budget, own: float, logging: float, wall: float = 1.2, start: int = 0, n: int = 60, every: int = 10):
    """Feed ``n`` logging windows; returns the sheds taken with their steps."""
    taken = []
    for i in range(n):
        step = start + (i + 1) * every
        shed = budget.window(step, own, wall, logging)
        if shed is not None:
            taken.append((step, shed))
    return taken


def test_a_per_step_cost_above_the_budget_is_said_at_the_first_decision_when_no_shed_can_lighten_it():
    """The per-step part alone (x WALL) is 28% of the step against a 5% budget; only cadence sheds are left: the
    budget says it cannot be kept at its first decision (step 300), not after shedding the cadence to no effect."""
    from trackdiag.session.budget_policy import WARMUP, Budget

    b = Budget(0.05, ["every x2", "every x5"])
    taken = _windows(b, own=0.2, logging=0.01, start=WARMUP - 50)
    assert b.cannot is not None and b.cannot["step"] == WARMUP and b.cannot["floor"] > 0.25
    assert [s for _, s in taken] == ["every x2", "every x5"]  # it still sheds what it may
    assert b.over()


def test_the_verdict_waits_for_a_shed_that_lightens_every_step_and_is_never_given_for_a_logging_heavy_cost():
    from trackdiag.session.budget_policy import WARMUP, Budget

    b = Budget(0.05, ["every x2", "every x5", "capture"])
    taken = _windows(b, own=0.2, logging=0.01, start=WARMUP - 50)
    assert [s for _, s in taken] == ["every x2", "every x5", "capture"]
    assert b.cannot is not None and b.cannot["step"] > taken[-1][0]  # judged again after the capture was shed
    light = Budget(0.05, ["every x2", "every x5"])
    _windows(light, own=0.2, logging=0.195, start=WARMUP - 50)  # the logging step is the cost: a cadence fixes it
    assert light.cannot is None
