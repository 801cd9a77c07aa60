"""A real SIGINT while a logging step's record is being published (probe by probe, from one host
copy): the Ctrl-C waits the millisecond publishing takes, so the record the run ends with has
every probe's values (a Ctrl-C'd example job lost its last window's loss series this way: the
loss probe had popped its values when the KeyboardInterrupt cut it short)."""
from __future__ import annotations

import json
import signal
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import digits, one_thread
from trackdiag.probes.loss import LossProbe
from trackdiag.core.record import read_records
from trackdiag.util.uninterrupted import uninterrupted


@pytest.fixture
def python_sigint(monkeypatch):
    """Python's own Ctrl-C handler, whatever the test runner installed."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _train(tmp_path, monkeypatch, at: int, stop: int = 100) -> tuple[int, list[tuple[int, float]], dict]:
    """Train until SIGINT lands inside the loss probe's publish at logging step ``at`` (or the loop
    is interrupted at step ``stop``); returns the step the KeyboardInterrupt came out of, the loss
    points on disk and the run's summary and status."""
    real = LossProbe.publish

    def publish(self, ctx, values, record):  # the signal arrives as the loss probe starts publishing
        if record.step == at:
            signal.raise_signal(signal.SIGINT)
        return real(self, ctx, values, record)

    monkeypatch.setattr(LossProbe, "publish", publish)
    xtr, ytr, _, _ = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    stopped = -1
    with one_thread(), pytest.raises(KeyboardInterrupt):
        with trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                   every=10) as diag:
            for step in range(100):
                x, y = xtr[step * 32:][:32], ytr[step * 32:][:32]
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                stopped = step
                diag.step(loss)
                if step == stop:
                    raise KeyboardInterrupt  # the first Ctrl-C, between steps
    losses = sorted((s, v) for r in read_records(tmp_path) for k, s, v in r.points() if k == "diag/loss")
    return stopped, losses, {**diag.summary(), **json.loads((tmp_path / "run.json").read_text())}


def test_a_ctrl_c_mid_publish_keeps_the_whole_record(tmp_path, monkeypatch, python_sigint) -> None:
    stopped, losses, summary = _train(tmp_path, monkeypatch, at=30)
    assert stopped == 30 and summary["status"] == "KILLED"
    assert [s for s, _ in losses] == list(range(31))  # the last window's series too (steps 21-30)
    assert summary["disabled_probes"] == {}


def test_a_second_ctrl_c_while_the_last_window_is_published_keeps_it(tmp_path, monkeypatch, python_sigint) -> None:
    """Ctrl-C at step 35, a second one while close() publishes steps 31-35: the report is skipped
    (what the second Ctrl-C is for), the last window's losses are not."""
    stopped, losses, summary = _train(tmp_path, monkeypatch, at=35, stop=35)
    assert stopped == 35 and summary["status"] == "KILLED"
    assert [s for s, _ in losses] == list(range(36))
    assert not (tmp_path / "report.html").exists()


def test_the_block_holds_the_signal_only_on_the_main_thread_with_pythons_handler(python_sigint) -> None:
    order: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            signal.raise_signal(signal.SIGINT)
            order.append("after the signal")  # still inside: the signal was held
    assert order == ["after the signal"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler

    mine: list[int] = []
    signal.signal(signal.SIGINT, lambda *a: mine.append(1))  # a handler of the user's: left alone
    with uninterrupted():
        signal.raise_signal(signal.SIGINT)
    assert mine == [1]

    seen: list[object] = []  # another thread: nothing to hold (signals go to the main thread)
    worker = threading.Thread(target=lambda: seen.append(_enter_and_report()))
    worker.start()
    worker.join()
    assert seen == [signal.getsignal(signal.SIGINT)]


def _enter_and_report() -> object:
    with uninterrupted():
        return signal.getsignal(signal.SIGINT)
