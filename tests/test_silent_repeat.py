"""Issue 45 item 6: identical batches across DataLoader workers (``repeated_batches``).

An ``IterableDataset`` whose ``__iter__`` does not shard by ``get_worker_info()`` is read whole by every worker; the
DataLoader interleaves the workers, so with ``num_workers=2`` each batch reaches the model twice in a row (each a new
tensor). ``same_batch`` needs 8 equal steps in a row and never sees it; ``repeated_batches`` (a warning) counts the
share of steps whose batch repeats the step before. Real DataLoader worker processes; the same stream sharded per
worker, and an unshuffled map-style dataset of two batches cycled epoch after epoch, stay silent.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import trackdiag
from _zoo_a import one_thread
from trackdiag.core.record import read_records

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}
PROTOS = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))


class Stream(IterableDataset):
    """A seeded stream of labelled points; ``shard``: each worker yields every ``num_workers``-th item (the fix)."""

    def __init__(self, n: int, shard: bool) -> None:
        self.n, self.shard = n, shard

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        info = get_worker_info()
        for i in range(self.n):
            y = int(torch.randint(0, 4, (), generator=gen))
            x = PROTOS[y] + 0.5 * torch.randn(8, generator=gen)
            if not self.shard or info is None or i % info.num_workers == info.id:
                yield x, y


def _train(tmp_path, loader, steps: int) -> tuple[trackdiag.Diagnostics, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen: list[torch.Tensor] = []
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF) as diag:
        step = 0
        while step < steps:
            for xb, yb in loader:
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                diag.step(loss, batch=(xb, yb))
                seen.append(xb)
                step += 1
                if step == steps:
                    break
    return diag, seen


def _warned(diag: trackdiag.Diagnostics) -> list[trackdiag.Alert]:
    return [a for a in diag.alerts if a.severity != "info"]


def test_unsharded_stream_read_by_two_workers_is_said_with_its_share(tmp_path) -> None:
    loader = DataLoader(Stream(4096, shard=False), batch_size=16, num_workers=2)
    diag, seen = _train(tmp_path, loader, 60)
    warned = _warned(diag)
    assert warned and warned[0].kind == "repeated_batches" and warned[0].severity == "warning", warned
    assert warned[0].step < 40 and "2.0 times in a row" in warned[0].message, warned[0].message
    assert "same_batch" not in {a.kind for a in diag.alerts}
    # reference: the share of steps whose batch equals the step before's, by torch.equal on the tensors themselves
    equal = [torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert sum(equal) == 30  # the DataLoader interleaves the two workers' identical streams
    records = [r for r in read_records(diag.summary()["output_dir"]) if "diag/data/repeat_judged" in r.scalars]
    judged = sum(r.scalars["diag/data/repeat_judged"] for r in records)
    repeats = sum(r.scalars["diag/data/repeat_share"] * r.scalars["diag/data/repeat_judged"] for r in records)
    assert judged == len(equal) and round(repeats) == sum(equal), (judged, repeats)


def test_sharded_stream_and_cycled_small_dataset_are_silent(tmp_path) -> None:
    sharded = DataLoader(Stream(4096, shard=True), batch_size=16, num_workers=2)
    diag, seen = _train(tmp_path / "sharded", sharded, 60)
    assert not any(torch.equal(a, b) for a, b in zip(seen, seen[1:]))
    assert not _warned(diag), _warned(diag)
    gen = torch.Generator().manual_seed(1)
    y = torch.randint(0, 4, (32,), generator=gen)
    data = list(zip(PROTOS[y] + 0.5 * torch.randn(32, 8, generator=gen), y.tolist()))
    cycled = DataLoader(data, batch_size=16, shuffle=False)  # two batches an epoch, the same two every epoch
    diag, seen = _train(tmp_path / "cycled", cycled, 60)
    assert torch.equal(seen[0], seen[2]) and not _warned(diag), _warned(diag)


def _ppo(tmp_path, take: str, objective: str = "auto", epochs: int = 4) -> trackdiag.Diagnostics:
    """A PPO-style update: each rollout (256 transitions) trained on for ``epochs`` full-batch epochs. ``take``: how
    the loop hands the rollout to the model each epoch: ``slice`` (``obs[:256]``: a view of the kept rollout),
    ``index`` (``obs[torch.arange(256)]``: a copy with the same contents), ``buffer`` (copied into one input
    tensor, ``buf.copy_(obs)``: the same object, changed in place)."""
    torch.manual_seed(0)
    pi = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.Adam(pi.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    buf = torch.empty(256, 8)
    with one_thread(), trackdiag.Diagnostics(pi, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, objective=objective) as diag:
        for _ in range(25):
            obs = torch.randn(256, 8, generator=g)
            with torch.no_grad():
                dist = torch.distributions.Categorical(logits=pi(obs))
                act = dist.sample()
                old = dist.log_prob(act)
                adv = (act == 0).float() - 0.25  # the first action pays
            for _ in range(epochs):
                o = {"slice": lambda: obs[:256], "index": lambda: obs[torch.arange(256)],
                     "buffer": lambda: buf.copy_(obs)}[take]()
                ratio = (torch.distributions.Categorical(logits=pi(o)).log_prob(act) - old).exp()
                loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                diag.step(loss, batch=(o, act))
    return diag


def test_ppo_epochs_over_a_kept_rollout_are_not_repeated_batches(tmp_path) -> None:
    """A view of the same region of the rollout, unchanged, is held data (as the same tensor object is): silent. The
    same contents re-indexed into new tensors repeat (a warning, which names the usual causes), unless the run is
    judged as RL (``objective="rl"``): then it is information that says why."""
    assert not _warned(_ppo(tmp_path / "slice", "slice"))
    indexed = _warned(_ppo(tmp_path / "index", "index"))
    assert [a.kind for a in indexed] == ["repeated_batches"], indexed
    rl = _ppo(tmp_path / "rl", "index", objective="rl")
    assert not _warned(rl)
    told = [a for a in rl.alerts if a.kind == "repeated_batches"]
    assert told and told[0].severity == "info" and "objective=\"rl\"" in told[0].message, told


def test_a_batch_copied_into_one_input_tensor_still_repeats(tmp_path) -> None:
    """The same object changed in place (its version counter moves) is not held data: ten epochs of one rollout
    copied into the input buffer are ``same_batch`` (8 equal steps in a row), a warning outside RL."""
    warned = _warned(_ppo(tmp_path, "buffer", epochs=10))
    assert "same_batch" in {a.kind for a in warned}, warned


def test_one_window_of_a_kept_corpus_every_step_still_repeats(tmp_path) -> None:
    """A view of the same part of a kept tensor every step (a loop whose data index never advances) is not held
    data: ``same_batch``, as for a loader restarted every step."""
    torch.manual_seed(0)
    corpus = torch.randn(64, 8)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF) as diag:
        for _ in range(40):
            x = corpus[0:16]  # the window that should move on with the step
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=x)
    assert [a.kind for a in _warned(diag)] == ["same_batch"], [(a.kind, a.step) for a in diag.alerts]


def _full_batch(tmp_path, make_batch, addresses: list[int] | None = None, **probes: dict) -> trackdiag.Diagnostics:
    """yunjey/pytorch-tutorial's linear regression: the data in numpy arrays, converted inside the loop each step
    (each step's tensors dropped before the next are made; ``addresses``: where each step's input lay)."""
    x_train = np.linspace(1.0, 10.0, 15, dtype=np.float32)[:, None]
    y_train = (0.3 * x_train + 0.5 + 0.1 * np.sin(7 * x_train)).astype(np.float32)
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes={**OFF, **probes}) as diag:
        for _ in range(60):
            inputs, targets = make_batch(x_train), make_batch(y_train)
            if addresses is not None:
                addresses.append(inputs.data_ptr())
            outputs = model(inputs)
            loss = F.mse_loss(outputs, targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=outputs, batch=(inputs, targets))
            del inputs, targets, outputs, loss
    return diag


def test_full_batch_numpy_wrapped_anew_each_step_is_held_data(tmp_path) -> None:
    """``torch.from_numpy(x_train)`` inside the loop is a new tensor each step over the same memory, all of it: held
    data, as the same tensor object is (it raised a ``same_batch`` warning at step 0 on this healthy tutorial)."""
    diag = _full_batch(tmp_path, torch.from_numpy)
    assert not _warned(diag), [(a.kind, a.step) for a in diag.alerts]


def test_a_batch_rebuilt_each_step_still_repeats(tmp_path) -> None:
    """The same contents copied anew each step (a restarted loader's collate), the step before's batch dropped first:
    still ``same_batch`` at step 0; only a tensor over the very memory of the step before's is held. (The previous
    step's storage is kept alive until the comparison, so an equal address cannot be freed memory handed back; here
    the NaN replay is off, whose ring of recent model inputs keeps them alive as well.)"""
    addresses: list[int] = []
    diag = _full_batch(tmp_path, lambda array: torch.from_numpy(array).clone(), addresses, nan_replay={"enabled": False})
    warned = _warned(diag)
    assert [(a.kind, a.step) for a in warned] == [("same_batch", 0)], [(a.kind, a.step) for a in diag.alerts]
    assert all(a != b for a, b in zip(addresses, addresses[1:]))  # each step's batch in memory of its own


def _pinn(tmp_path, batch_of) -> trackdiag.Diagnostics:
    """A PINN tutorial's loop (nanditadoloi/PINN): the boundary points converted from numpy each step (a new tensor,
    the same values) beside collocation points drawn afresh each step; ``batch_of(boundary, collocation)``."""
    boundary = np.random.RandomState(0).uniform(size=(200, 2))  # float64: .float() copies it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF) as diag:
        for _ in range(40):
            fixed, fresh = torch.from_numpy(boundary).float(), torch.rand(1000, 2)
            x = torch.cat([fixed, fresh])
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=batch_of(fixed, fresh))
    return diag


def test_a_batch_whose_other_floating_parts_change_is_not_repeated(tmp_path) -> None:
    """The PINN tutorial's batch, its fixed part first (the rehearsal of 2026-12-03: a ``same_batch`` warning at step
    0 on this healthy loop: only the first tensor was fingerprinted); the whole batch rebuilt with the same values
    each step still repeats."""
    for name, batch_of in {"pair": lambda a, b: (a, b), "five": lambda a, b: (a[:, :1], a[:, 1:], a.sum(1), b[:, :1], b[:, 1:]),
                           "dict": lambda a, b: {"input": a, "collocation": b}}.items():
        diag = _pinn(tmp_path / name, batch_of)
        assert not _warned(diag), (name, [(a.kind, a.step) for a in diag.alerts])
    diag = _pinn(tmp_path / "same", lambda a, b: (a, a * 2.0))
    assert [(a.kind, a.step) for a in _warned(diag)] == [("same_batch", 0)], [(a.kind, a.step) for a in diag.alerts]
