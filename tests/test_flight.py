"""The flight recorder: a script that dies mid-step (an exception raised after a NaN forward, an
unrelated RuntimeError, SIGTERM) gets ONE ``crash`` finding in the local record, the console and the
MLflow run, with the step, the module whose output went non-finite (or that was running), and the
last steps of the loss and gradient-norm series; the exception and the exit status are untouched;
Ctrl-C gives none. Real loops (tests/_zoo_crash.py), a real SQLite MLflow store, real subprocesses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import trackdiag
from trackdiag.util import exit_status
from trackdiag.core.record import read_records

import _warm as warm
import _zoo_crash as zoo

REPO = Path(__file__).resolve().parents[1]
LOCATED = {"basic": "", "advanced": "{m} ({t}, input finite)", "extreme": "{m} ({t}, input finite, seen in the step's forward)"}


@pytest.fixture(autouse=True)
def _fresh_exit_status():
    exit_status._reset_for_tests()
    yield
    exit_status._reset_for_tests()


def _capture(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The sessions the loops build (they raise before returning theirs)."""
    made: list[Any] = []
    real = trackdiag.Diagnostics.__init__

    def init(self: Any, *a: Any, **k: Any) -> None:
        real(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(trackdiag.Diagnostics, "__init__", init)
    return made


def _local(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any], list[Any]]:
    """(alerts.json, run.json, records) of a local record."""
    return (json.loads((out / "alerts.json").read_text()), json.loads((out / "run.json").read_text()),
            list(read_records(out)))


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
@pytest.mark.parametrize(("script", "error", "module", "kind"), [
    ("vae", RuntimeError, "dec.2", "NanGate"),   # binary_cross_entropy raises on the NaN reconstruction
    # Categorical(probs=NaN) raises ValueError; once torch._dynamo has been imported (any torch.compile in the
    # process) it turns distribution validation off, and torch.multinomial raises RuntimeError on the NaN instead
    ("rl", (ValueError, RuntimeError), "body.2", "NanGate"),
])
def test_a_nan_forward_that_kills_the_script_is_explained(tmp_path, monkeypatch, level, script, error, module, kind):
    made = _capture(monkeypatch)
    with pytest.raises(error) as raised:  # the user's exception is not swallowed
        getattr(zoo, script)(level, tmp_path, onset=12)
    (diag,) = made
    (crash,) = diag.alerts  # nothing before the crash: the NaN never reached step()
    assert (crash.kind, crash.step, crash.severity) == ("crash", 12, "critical")
    assert crash.where == LOCATED[level].format(m=module, t=kind), crash
    if level != "basic":
        assert module in crash.message and "NaN" in crash.message
    else:  # nothing watched the modules: the hint says how to have it named
        assert "level='advanced'" in crash.hint and "flight.modules=true" in crash.hint
    assert f"{raised.type.__name__}: " in crash.message and "loss at steps 2-11: " in crash.message
    assert "grad norm at steps 2-11: " in crash.message
    alerts, run, records = _local(tmp_path)
    assert run["status"] == "FAILED" and [a["kind"] for a in alerts] == ["crash"]
    assert alerts[0]["where"] == crash.where and alerts[0]["step"] == 12
    last = records[-1]
    assert [a.to_dict() for a in last.alerts] == [crash.to_dict()] and list(last.tables["crash/loss"]) == [str(s) for s in range(2, 12)]
    losses = dict((s, v) for r in records for s, v in r.series.get("diag/loss", []))
    assert sorted(losses) == list(range(12))  # nothing lost: every completed step's loss is in the record
    assert last.tables["crash/loss"] == {str(s): losses[s] for s in range(2, 12)}
    assert diag.summary()["alerts"]["crash"]["count"] == 1


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
@pytest.mark.parametrize("script", ["vae", "rl"])
def test_healthy_loops_say_nothing(tmp_path, level, script):
    diag = getattr(zoo, script)(level, tmp_path, onset=None, steps=25)
    assert [a for a in diag.alerts if a.severity != "info"] == [], [a.describe() for a in diag.alerts]
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "FINISHED"


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_an_unrelated_error_gets_a_crash_finding_without_a_culprit(tmp_path, monkeypatch, level):
    made = _capture(monkeypatch)
    with pytest.raises(RuntimeError, match="environment server disconnected"):
        zoo.rl(level, tmp_path, raise_at=9)
    (crash,) = made[0].alerts
    assert (crash.kind, crash.step, crash.where) == ("crash", 9, "")
    assert "RuntimeError: environment server disconnected at step 9" in crash.message
    assert "loss at steps 0-8: " in crash.message and "Not a non-finite fault" in crash.hint
    if level == "advanced":  # a replay of the running step on its weights: finite
        assert "was finite in every module output" in crash.message
    if level == "extreme":  # the flags of the real step: finite
        assert "were finite" in crash.message
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "FAILED"


def test_ctrl_c_is_not_a_crash_and_the_finding_is_written_once(tmp_path, monkeypatch):
    made = _capture(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        with trackdiag.Diagnostics(zoo.mlp_model(), None, level="advanced", sinks=["local"], output_dir=str(tmp_path / "a")):
            raise KeyboardInterrupt
    assert made[0].alerts == [] and json.loads((tmp_path / "a" / "run.json").read_text())["status"] == "KILLED"
    model = zoo.mlp_model()
    diag = trackdiag.Diagnostics(model, None, level="advanced", sinks=["local"], output_dir=str(tmp_path / "b"))
    try:
        with diag:
            model(zoo.digits()[0][:8]).sum().backward()
            diag.step(None)
            raise OSError("disk full")
    except OSError:
        diag.close()  # a second close (in the handler) adds nothing
    diag.close()
    assert [a.kind for a in diag.alerts] == ["crash"] and "OSError: disk full" in diag.alerts[0].message
    assert [a["kind"] for a in json.loads((tmp_path / "b" / "alerts.json").read_text())] == ["crash"]


@pytest.mark.parametrize("where", ["collect", "judge", "emit"])
def test_ctrl_c_inside_a_logging_step_keeps_that_step_in_the_record(tmp_path, monkeypatch, where):
    """SIGINT lands wherever the main thread is; on a logging step it used to land after the window
    was marked logged and before its record reached the sinks: the last loss point was lost."""
    import trackdiag.session.diagnostics as session_mod

    def interrupt(real):
        def hit(*a, **k):
            if diag._step == 10 and not fired:
                fired.append(True)
                raise KeyboardInterrupt
            return real(*a, **k)
        return hit

    fired: list[bool] = []

    model = zoo.mlp_model()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path), every=5)
    target = {"collect": (session_mod, "to_host"), "judge": (session_mod, "enrich_alerts"),
              "emit": (type(diag), "_emit")}[where]
    monkeypatch.setattr(*target, interrupt(getattr(*target)))
    x, y = zoo.digits()
    with pytest.raises(KeyboardInterrupt), diag:
        for step in range(20):
            loss = F.cross_entropy(model(x[:64]), y[:64])
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss)
    assert fired
    steps = sorted(s for r in read_records(tmp_path) for k, s, _ in r.points() if k == "diag/loss")
    assert steps == list(range(11)), steps  # the interrupted step's loss too, once (close() logged it)
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "KILLED"


def test_without_with_the_uncaught_exception_is_described_at_exit(tmp_path, monkeypatch):
    """No ``with``: sys.excepthook sees the exception, the session closes later (atexit) with it."""
    made = _capture(monkeypatch)
    err = zoo.run_quietly(zoo.vae, "advanced", tmp_path, onset=7, use_with=False)[1]
    assert isinstance(err, RuntimeError)
    monkeypatch.setattr(sys, "__excepthook__", lambda *a: None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    exit_status.install()
    monkeypatch.setattr(exit_status, "_installed_pid", None)
    sys.excepthook(type(err), err, err.__traceback__)  # what Python does with an uncaught exception
    made[0].close()  # what atexit does
    (crash,) = made[0].alerts
    assert crash.step == 7 and crash.where == "dec.2 (NanGate, input finite)", crash
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "FAILED"


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_the_mlflow_run_holds_the_finding(tmp_path, monkeypatch, level):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from _mlflow_util import ready_store

    monkeypatch.chdir(tmp_path)
    store = ready_store(tmp_path / "store")
    made = _capture(monkeypatch)
    with pytest.raises(RuntimeError):
        zoo.vae(level, tmp_path / "run", onset=12, sinks=["mlflow"],
                sink={"mlflow": {"tracking_uri": store, "experiment": "crash", "delivery": "thread"}})
    sink = next(s for s in made[0]._hub.sinks if s.name == "mlflow")
    client = MlflowClient(store)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FAILED" and run.data.tags["trackdiag.alert.crash"] == "12"
    counts = sorted((m.step, m.value) for m in client.get_metric_history(sink.run_id, "diag/alerts/crash"))
    assert counts[-1] == (12, 1.0) and all(v == 0.0 for s, v in counts if s < 12)  # on the loss's step axis
    alerts = json.loads(Path(client.download_artifacts(sink.run_id, "alerts.json", str(tmp_path))).read_text())
    (crash,) = alerts
    assert crash["kind"] == "crash" and crash["step"] == 12 and crash["where"].startswith("dec.2 (NanGate")
    assert "loss at steps 2-11" in crash["message"] and "grad norm at steps 2-11" in crash["message"]
    loss = sorted((m.step, m.value) for m in client.get_metric_history(sink.run_id, "diag/loss"))
    assert [s for s, _ in loss] == list(range(12))  # every completed step delivered


SIGTERM_SCRIPT = """
import time, torch
from torch import nn
import trackdiag

class Slow(nn.Module):  # stands for a long forward: the signal arrives inside it
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.wait = False
    def forward(self, x):
        if self.wait:
            open(OUT + ".ready", "w").close()
            time.sleep(60)
        return self.lin(x)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Slow(), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
diag = trackdiag.Diagnostics(model, opt, level=LEVEL, every=5, sinks=["local", "console", "mlflow"], output_dir=OUT,
                             sink={"mlflow": {"tracking_uri": STORE, "experiment": "sigterm"}})

def train():
    for step in range(100):
        model[2].wait = step == 17
        x = torch.randn(16, 8)
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (16,)))
        loss.backward(); opt.step(); opt.zero_grad()
        diag.step(loss)

RUN
"""


@pytest.mark.slow
@pytest.mark.parametrize(("level", "use_with"), [("advanced", True), ("basic", False)])
def test_sigterm_mid_step_is_recorded_everywhere(tmp_path, level, use_with):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from _mlflow_util import ready_store

    out = tmp_path / "run"
    store = ready_store(tmp_path)
    body = SIGTERM_SCRIPT.replace("OUT", repr(str(out))).replace("STORE", repr(store)).replace("LEVEL", repr(level))
    body = body.replace("RUN", "with diag:\n    train()" if use_with else "train()  # no with: closed at exit")
    (tmp_path / "script.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = warm.popen([sys.executable, "script.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not Path(str(out) + ".ready").exists() and time.monotonic() - t0 < 120 and proc.poll() is None:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    alerts, run, records = _local(out)
    assert run["status"] == "KILLED"
    (crash,) = alerts
    assert crash["kind"] == "crash" and crash["step"] == 17 and "killed by SIGTERM" in crash["message"]
    assert crash["where"] == "2 (Slow, running in its forward)", crash
    assert "loss at steps 7-16" in crash["message"] and "SIGTERM" in crash["hint"]
    assert "crash" in err and "run KILLED" in err, err[-2000:]
    client = MlflowClient(store)
    [mrun] = client.search_runs([client.get_experiment_by_name("sigterm").experiment_id])
    assert mrun.info.status == "KILLED" and mrun.data.tags["trackdiag.alert.crash"] == "17"
    got = json.loads(Path(client.download_artifacts(mrun.info.run_id, "alerts.json", str(tmp_path))).read_text())
    assert got == alerts
    loss = sorted(m.step for m in client.get_metric_history(mrun.info.run_id, "diag/loss"))
    assert loss == list(range(17))  # nothing lost


def test_health_shown_for_a_crash_is_the_status_unless_other_alerts_say_worse():
    from trackdiag.sinks.console import display_health

    crash = {"count": 1, "first_step": 5, "severity": "critical"}
    assert display_health({"health": "critical", "status": "FAILED", "alerts": {"crash": crash}}) == "failed"
    assert display_health({"health": "critical", "status": "KILLED", "alerts": {"crash": crash}}) == "killed"
    both = {"crash": crash, "nonfinite_loss": {**crash, "first_step": 3}}
    assert display_health({"health": "critical", "status": "FAILED", "alerts": both}) == "critical"
    spike = {"crash": crash, "loss_spike": {**crash, "severity": "warning"}}
    assert display_health({"health": "critical", "status": "FAILED", "alerts": spike}) == "warning"


def test_extreme_flags_watch_through_call_slots_and_leave_other_models_on_the_fast_path(tmp_path):
    """extreme's per-module output flags watch each module of the session's models through its own call
    slot: no global forward hook is installed (with one, every module call of the process takes PyTorch's
    slower path: another model's too), a planted NaN still names its module from the flags, and at close
    every slot is given back."""
    from torch import nn

    from trackdiag.core.registry import PROBES
    from trackdiag.capture.root_call import SLOT

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), zoo.NanGate(nn.Linear(16, 16)), nn.ReLU(), nn.Linear(16, 2))
    other = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # not the session's: must keep the fast path
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probes = {"activations": {"enabled": False}, "report": {"enabled": False}, "landscape": {"enabled": False},
              "histograms": {"enabled": False}, "preflight": {"enabled": False}}
    diag = trackdiag.Diagnostics(model, opt, level="extreme", sinks=["local"], output_dir=str(tmp_path), every=5,
                                 probes={k: v for k, v in probes.items() if k in PROBES})
    hooks = torch.nn.modules.module._global_forward_hooks
    with diag:
        flags = next(p for p in diag.probes if p.name == "flight").flags
        assert flags is not None
        for step in range(8):
            model[2].fault.fill_(1.0 if step == 6 else 0.0)
            x = torch.randn(4, 8)
            other(x)
            loss = F.cross_entropy(model(x), torch.randint(2, (4,)))
            assert not hooks, "a global forward hook puts every module call of the process on the slow path"
            assert all(SLOT in m.__dict__ for m in model.modules()) and not any(SLOT in m.__dict__ for m in other.modules())
            if step == 6:
                assert flags.first_bad(step, running=True)[0] == ("", "2")  # the flags of the real forward
                break
            loss.backward()
            opt.step()
            opt.zero_grad()
            diag.step(loss)
    assert not any(SLOT in m.__dict__ for m in model.modules())


def _crash_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
              loss_of: Any, error: type[BaseException]) -> Any:
    """Trains ``model`` on ``batches`` at ``advanced`` until it raises ``error``; the session's one alert."""
    made = _capture(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error):
        with trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                   probes={"report": {"enabled": False}}) as diag:
            for x, y in batches:
                out = model(x)
                loss = loss_of(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                diag.step(loss, outputs=out, batch=(x, y))
    (crash,) = made[0].alerts
    return crash


@pytest.mark.parametrize(("shift", "named"), [(1, "a target of 10 where"), (-100, None)])
def test_labels_outside_the_classes_are_named_as_the_cause(tmp_path, monkeypatch, shift, named) -> None:
    """Labels 1..10 for 10 outputs (a shift of 1) crash cross_entropy at the step the label 10 comes: the hint says
    which target and the usual causes, not 'see the traceback'. A padding label of -1 without ignore_index: the
    hint says to pass it as ignore_index."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    labels = [torch.randint(0, 9, (16,)) for _ in range(6)]
    labels[4][3] = 9  # the 10th class first appears in the fifth batch
    if shift == 1:
        labels = [y + 1 for y in labels]
    else:
        labels[4][5] = -1
    crash = _crash_of(tmp_path, monkeypatch, model, [(torch.randn(16, 8), y) for y in labels], F.cross_entropy, IndexError)
    assert (crash.kind, crash.step) == ("crash", 4)
    assert "Not a non-finite fault" not in crash.hint and "A class target outside [0, C)" in crash.hint, crash.hint
    if named:
        assert named in crash.hint and "labels numbered 1..C" in crash.hint
    else:
        assert "a target of -1" in crash.hint and "ignore_index=-1" in crash.hint
    assert "out of bounds.." not in crash.message and "Target" in crash.message


def test_an_embedding_index_past_the_vocabulary_is_named_as_the_cause(tmp_path, monkeypatch) -> None:
    """A token id equal to the vocabulary size (an added token, the model's embedding not resized)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(32, 3))
    ids = [torch.randint(0, 50, (4, 4)) for _ in range(5)]
    ids[3][1, 2] = 50
    batches = [(x, torch.randint(0, 3, (4,))) for x in ids]
    crash = _crash_of(tmp_path, monkeypatch, model, batches, F.cross_entropy, IndexError)
    assert (crash.kind, crash.step) == ("crash", 3)
    assert "nn.Embedding" in crash.hint and "resize_token_embeddings" in crash.hint, crash.hint


def test_a_cuda_device_side_assert_is_said_to_be_reported_late() -> None:
    """CUDA's asynchronous kernel errors (PyTorch's own message text; a CUDA device to raise one is not needed to
    judge the text): the hint says the traceback's line may be late, how to make it raise where it fails, and the
    usual causes. Out of memory keeps its own hint."""
    from trackdiag.forensics.crash import crash_hint

    exc = torch.AcceleratorError("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
                                 "reported at some other API call, so the stacktrace below might be incorrect.\n"
                                 "For debugging consider passing CUDA_LAUNCH_BLOCKING=1") \
        if hasattr(torch, "AcceleratorError") else RuntimeError("CUDA error: device-side assert triggered")
    hint = crash_hint(exc, signalled=False, watched=True)
    assert "CUDA_LAUNCH_BLOCKING=1" in hint and "class target outside [0, C)" in hint and "later call" in hint
    oom = crash_hint(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), signalled=False, watched=True)
    assert oom.startswith("Out of memory")
