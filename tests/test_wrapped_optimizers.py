"""Wrapped, late and closure-stepped optimizers (issue: Accelerate loops, trainers that own the
optimizer, Lightning's closures, GANs). Real ``accelerate`` on the CPU, offline; references
computed in the loop by hand in float64."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _loops import ref_norm
from _zoo_a import digits, one_thread, quiet_probes
from trackdiag.core.record import read_records
from _clip import clip_checked

accelerate = pytest.importorskip("accelerate", reason="pip install 'trackdiag[accelerate]'")


def points(out, key: str) -> dict[int, float]:
    return {s: v for r in read_records(out) for k, s, v in r.points() if k == key}


def warned(diag) -> list:
    return [a for a in diag.alerts if a.severity in ("warning", "critical")]


class Named(nn.Module):
    """An MLP whose middle block can make a NaN from log(0) once ``broken`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64)
        self.block = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)
        self.broken = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(torch.relu(self.embed(x)))
        if self.broken:
            h = torch.log(h * 0.0)  # the planted fault: log(0) = -inf inside 'block'
        return self.head(h)


class LogBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.broken = False

    def forward(self, x):
        h = torch.relu(self.lin(x))
        return torch.log(h * 0.0) if self.broken else h


def accelerate_loop(tmp_path, *, accum: int, clip: bool, built: str, steps: int = 24, fault: str | None = None,
                    fault_at: int = 10, lr: float = 1e-3):
    """A ``*_no_trainer``-style loop: prepare, accumulate, accelerator.backward, a scheduler per step.
    Returns (diag, reference pre-clip norms per real optimizer step)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(0)
    xtr, ytr, _, _ = digits()
    ds = torch.utils.data.TensorDataset(xtr, ytr)
    loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), LogBlock(), nn.Linear(64, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    accelerator = Accelerator(gradient_accumulation_steps=accum, cpu=True)
    make = lambda m, o: trackdiag.Diagnostics(m, o, level="advanced", every=5, sinks=["local"],  # noqa: E731
                                              output_dir=str(tmp_path), probes=quiet_probes())
    diag = make(model, opt) if built == "before" else None
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if diag is None:
        diag = make(model, opt)
    refs: list[float] = []
    real = 0
    with one_thread(), diag:
        micro = 0
        while real < steps:
            for x, y in loader:
                if fault == "lr" and real == fault_at and micro % accum == 0:
                    for g in opt.param_groups:
                        g["initial_lr"] = g["initial_lr"] * 1000 if "initial_lr" in g else g["lr"] * 1000
                    sched.base_lrs = [b * 1000 for b in sched.base_lrs]
                model[2].broken = fault == "nan" and real >= fault_at
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if clip:
                            refs.append(float(clip_checked(model.parameters(), 0.05, accelerator.clip_grad_norm_)))
                        else:
                            refs.append(ref_norm(model.parameters()))
                    opt.step()
                    sched.step()
                    if fault == "wipe":
                        model.zero_grad()  # wipes the accumulation window
                    elif not (fault == "no_zero" and real >= fault_at):
                        opt.zero_grad()
                micro += 1
                diag.step(loss)
                if accelerator.sync_gradients:
                    real += 1
                if real >= steps:
                    break
    return diag, refs


@pytest.mark.parametrize("built", ["before", "after"])
@pytest.mark.parametrize("accum,clip", [(1, False), (4, False), (4, True), (1, True)])
def test_accelerate_pre_clip_norms_every_real_step(tmp_path, built: str, accum: int, clip: bool) -> None:
    diag, refs = accelerate_loop(tmp_path, accum=accum, clip=clip, built=built)
    got = points(tmp_path, "diag/grad/global_norm")
    assert sorted(got) == list(range(len(refs)))  # one trackdiag step per real optimizer step
    for step, ref in enumerate(refs):
        assert got[step] == pytest.approx(ref, rel=1e-5), step
    if clip:
        assert any(r > 0.05 for r in refs)  # the clip bit: a post-clip reading would be 0.05
    loss = points(tmp_path, "diag/loss")
    assert sorted(loss) == list(range(len(refs)))  # the loss of each real step (mean of its micro-batches)
    assert warned(diag) == []


def test_accelerate_wrapper_is_followed_without_private_hooks(tmp_path) -> None:
    """The prepared optimizer runs no torch hooks of its own: the one that steps is found inside."""
    diag, refs = accelerate_loop(tmp_path, accum=1, clip=False, built="after", steps=6)
    comp = diag.components[0]
    assert type(comp.given[0]).__name__ == "AcceleratedOptimizer" and isinstance(comp.optimizer, torch.optim.AdamW)
    assert points(tmp_path, "diag/opt/lr")


def test_accelerate_accumulation_window_wipe_is_caught(tmp_path) -> None:
    diag, _ = accelerate_loop(tmp_path, accum=4, clip=False, built="after", steps=12, fault="wipe")
    (a,) = [a for a in diag.alerts if a.kind == "accumulation_reset"][:1]
    assert a.step == 0 and "4 backward passes" in a.message and "zero_grad" in a.hint
    assert not [a for a in diag.alerts if a.kind == "grads_not_zeroed"]


def test_accelerate_missing_zero_grad_is_caught(tmp_path) -> None:
    diag, _ = accelerate_loop(tmp_path, accum=4, clip=False, built="after", steps=16, fault="no_zero", fault_at=6)
    (a,) = [a for a in diag.alerts if a.kind == "grads_not_zeroed"][:1]
    assert a.step == 7  # the first optimizer step that used the previous step's gradients too


def test_accelerate_nan_in_a_named_module(tmp_path) -> None:
    diag, _ = accelerate_loop(tmp_path, accum=4, clip=True, built="after", steps=16, fault="nan", fault_at=7)
    a = next(a for a in diag.alerts if a.kind == "nonfinite_loss")
    assert a.step == 7 and a.where.startswith("2 (LogBlock, input finite)")


class OwnTrainer:
    """A trainer that builds its own optimizer inside ``run()`` and calls back after each batch."""

    def __init__(self, model: nn.Module, on_batch_end, on_after_backward=None, lr: float = 0.05) -> None:
        self.model, self.on_batch_end, self.on_after_backward, self.lr = model, on_batch_end, on_after_backward, lr

    def run(self, steps: int) -> None:
        xtr, ytr, _, _ = digits()
        opt = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)  # built here, never handed out
        gen = torch.Generator().manual_seed(0)
        for step in range(steps):
            idx = torch.randint(len(xtr), (32,), generator=gen)
            loss = F.cross_entropy(self.model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            if self.on_after_backward:
                self.on_after_backward(step)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            opt.step()
            self.on_batch_end(step, loss)


def test_trainer_owned_optimizer_is_found_at_its_first_step(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    refs = {}
    with one_thread():
        diag = trackdiag.Diagnostics(model, None, level="advanced", every=5, sinks=["local"], output_dir=str(tmp_path),
                                     probes=quiet_probes())
        assert "no optimizer" in diag.summary()["notes"][0]
        trainer = OwnTrainer(model, lambda s, loss: diag.step(loss),
                             on_after_backward=lambda s: refs.__setitem__(s, ref_norm(model.parameters())))
        with diag:
            trainer.run(20)
    got = points(tmp_path, "diag/grad/global_norm")
    assert sorted(got) == list(range(20))
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step
    assert 0 in points(tmp_path, "diag/opt/lr") and 0 in points(tmp_path, "diag/update/global_ratio")
    assert diag.summary()["notes"] == []  # adopted: nothing left unmeasured
    assert warned(diag) == []


def test_trainer_owned_optimizer_lr_blowup_is_caught(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    with one_thread():
        diag = trackdiag.Diagnostics(model, None, level="advanced", every=10, sinks=["local"], output_dir=str(tmp_path),
                                     probes=quiet_probes())
        with diag:
            OwnTrainer(model, lambda s, loss: diag.step(loss), lr=50.0).run(30)
    kinds = {a.kind: a.step for a in warned(diag)}
    assert kinds and min(kinds.values()) <= 10, kinds


def test_closure_stepped_adamw_reads_this_steps_gradients(tmp_path) -> None:
    """Lightning's way: optimizer.step(closure) where the closure runs training_step, zero_grad and
    backward inside step(); zeroing is skipped from step 15 on."""
    torch.manual_seed(0)
    xtr, ytr, _, _ = digits()
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refs = {}
    with one_thread():
        diag = trackdiag.Diagnostics(model, opt, level="advanced", every=5, sinks=["local"], output_dir=str(tmp_path),
                                     probes=quiet_probes())
        with diag:
            gen = torch.Generator().manual_seed(1)
            for step in range(25):
                idx = torch.randint(len(xtr), (32,), generator=gen)

                def closure():
                    loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
                    if step < 15:
                        opt.zero_grad()
                    loss.backward()
                    refs[step] = ref_norm(model.parameters())
                    return loss

                loss = opt.step(closure)
                diag.step(loss)
    got = points(tmp_path, "diag/grad/global_norm")
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step
    verdicts = points(tmp_path, "diag/grad/not_zeroed")
    assert verdicts and all(v == 0.0 for s, v in verdicts.items() if s < 15)
    (a,) = [a for a in diag.alerts if a.kind == "grads_not_zeroed"][:1]
    assert a.step == 15


def gan(tmp_path, steps: int, drop_d_from: int | None = None, every: int = 10):
    """Two models, two optimizers, DCGAN-style updates on a 2-D mixture of Gaussians."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    d = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    og = torch.optim.Adam(g.parameters(), 1e-3, betas=(0.5, 0.999))
    od = torch.optim.Adam(d.parameters(), 1e-3, betas=(0.5, 0.999))
    centers = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    gen = torch.Generator().manual_seed(0)
    with one_thread():
        diag = trackdiag.Diagnostics({"G": g, "D": d}, {"G": og, "D": od}, level="advanced", every=every,
                                     sinks=["local"], output_dir=str(tmp_path), probes=quiet_probes())
        with diag:
            for step in range(steps):
                real = centers[torch.randint(4, (64,), generator=gen)] + 0.1 * torch.randn(64, 2, generator=gen)
                fake = g(torch.randn(64, 4, generator=gen))
                d.zero_grad()
                ld = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
                ld.backward()
                if drop_d_from is None or step < drop_d_from:
                    od.step()
                g.zero_grad()
                lg = F.softplus(-d(fake)).mean()
                lg.backward()
                og.step()
                diag.step({"G": lg, "D": ld})
    return diag


def test_gan_healthy_adversarial_training_raises_nothing(tmp_path) -> None:
    diag = gan(tmp_path, 300)
    assert warned(diag) == []


def test_gan_discriminator_optimizer_stops_stepping(tmp_path) -> None:
    diag = gan(tmp_path, 260, drop_d_from=150)
    # optimizer_idle says it at its first step since 2026-12-03; stale_params, 50 steps later, folds into it
    stale = [a for a in diag.alerts if a.kind in ("stale_params", "optimizer_idle")]
    assert stale and stale[0].where.startswith("D") and 150 <= stale[0].step <= 150 + 60, stale
    assert (stale[0].kind, stale[0].step) == ("optimizer_idle", 150), stale
    assert not [a for a in stale if a.where.startswith("G")]
