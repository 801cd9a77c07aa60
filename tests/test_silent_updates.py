"""Issue 45 item 4: updates that do not land. An optimizer that steps, with gradients reaching the
model, while the weights do not move at all (a learning rate of 0 here; an optimizer holding only tensors
the model no longer uses, or a patched step, read the same): ``stale_params`` warning, "the updates do not
land". Before: ``stale_params`` said each layer "no longer changes" at info only.
Healthy twins raise nothing of warning or worse: a warm-up from a learning rate of 0 with an EMA copy of
the model updated by hand (weights moved with no optimizer: not a watched component), and a GAN (two
components, two optimizers on disjoint parts, the discriminator frozen for the generator's step).
"""
from __future__ import annotations

from _silent_loops import loud, run, said
from _zoo_a import gan


def test_lr_zero_updates_do_not_land(tmp_path) -> None:
    diag, losses = run(tmp_path, "lr0")
    found = loud(diag, "stale_params")
    assert len(found) == 1 and found[0].step <= 100, said(diag)
    assert "do not land" in found[0].message and "learning rate is 0" in found[0].message
    assert found[0].where == "(all layers)"


def test_warmup_from_zero_with_ema_stays_quiet(tmp_path) -> None:
    diag, losses = run(tmp_path, warmup=20, ema=True)
    assert sum(losses[-20:]) / 20 < 0.5 * losses[0]
    assert loud(diag) == [], said(diag)


def test_gan_stays_quiet(tmp_path) -> None:
    diag = gan(tmp_path, steps=150)
    assert [a for a in diag.alerts if a.kind == "stale_params" and a.severity != "info"] == [], said(diag)


def test_lr_blowup_under_adam_and_clipping_is_said_by_the_update(tmp_path) -> None:
    """An on-policy policy gradient, Adam + clip_grad_norm_(0.5), every learning rate x1000 at step 120: the
    gradient is clipped to its usual size; the step of the weights jumps. Before: no update_scale (no rule);
    update_ratio stays quiet (the step is far below the weights' size)."""
    from _silent_loops import on_policy

    diag, _ = on_policy(tmp_path, onset=120)
    found = loud(diag, "update_scale")
    assert found and 120 <= found[0].step <= 170, said(diag)
    assert "learning rate rose" in found[0].message
    assert not [a for a in diag.alerts if a.kind == "update_ratio"]


def test_on_policy_healthy_stays_quiet(tmp_path) -> None:
    from _silent_loops import on_policy

    diag, rewards = on_policy(tmp_path)
    assert sum(rewards[-20:]) > sum(rewards[:20]) + 5  # it learns
    assert loud(diag) == [], said(diag)


def test_a_warm_up_is_not_a_jump(tmp_path) -> None:
    """The corpus's accelerate loop warms its learning rate up 15x between the first ten steps and step 50 (the next
    update measurement at ``advanced``), its step 10x the usual: a ramp over the logging steps, not a jump, so no
    ``update_scale`` (it was critical at step 50 on both seeds)."""
    from _styles import load

    run = load("accelerate_cv").run(tmp_path, level="advanced", seed=0, steps=300)
    assert [a for a in run.diag.alerts if a.kind == "update_scale"] == []


def test_a_warm_restart_is_not_a_jump(tmp_path) -> None:
    """SGDR (``CosineAnnealingWarmRestarts``): every 60 steps the rate returns from ~0 to its base, a 10-1000x rise
    in one step, by design. Before: ``update_scale`` took the restart for a blow-up (the steps measured late in a
    cycle are tiny, the first after the restart 3x their median). A rise to no more than 1.5x the run's largest
    rate so far is a revisit, not a jump; a planted x1000 after the restarts is still said (by the gradient, under SGD)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import trackdiag
    from _zoo_a import one_thread

    def run(out, plant: bool) -> trackdiag.Diagnostics:
        torch.manual_seed(4)
        gen = torch.Generator().manual_seed(13)
        teacher = torch.randn(16, 4, generator=gen)
        x = torch.randn(1024, 16, generator=gen)
        y = (x @ teacher).argmax(1)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=60)
        with one_thread(), trackdiag.Diagnostics(model, opt, level="extreme", sinks=["local"], output_dir=str(out),
                                                 probes={"report": {"enabled": False}}) as diag:
            for step in range(200):
                i = torch.randint(0, 1024, (32,), generator=gen)
                loss = F.cross_entropy(model(x[i]), y[i])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                if plant and step == 150:
                    sched.base_lrs = [b * 1000 for b in sched.base_lrs]
                diag.step(loss, batch=(x[i], y[i]))
        return diag

    healthy = run(tmp_path / "healthy", plant=False)
    assert [a for a in healthy.alerts if a.kind == "update_scale"] == [], said(healthy)
    planted = run(tmp_path / "planted", plant=True)
    first = [a for a in planted.alerts if a.severity != "info"]
    assert first and first[0].kind == "grad_explosion" and 150 <= first[0].step <= 160, said(planted)
