"""Issue 15, item 1: one redaction policy, applied before anything leaves the process or reaches disk.

A real session with every sink (local record, console, MLflow on a real SQLite store, W&B offline
read back from its ``.wandb`` file) gets hyperparameters holding secrets under telling keys
(``api_key``, ``db.Password``, ``WANDB_API_KEY``...) and under innocent ones (a URL with
``user:pass@``, an ``Authorization: Bearer`` header, a GitHub token). No secret may appear in any
byte written under the test's directory (MLflow's database and artifacts included), on the console
or in the log; the values that are not secret stay readable.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

import yaml  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.core.errors import ConfigError  # noqa: E402
from trackdiag.util.redact import MASK, RedactPolicy  # noqa: E402
from trackdiag.core.runinfo import RunInfo, redact_override  # noqa: E402
from trackdiag.sinks.mlflow.sink import MlflowSink  # noqa: E402
from trackdiag.sinks.wandb_util import redact as wandb_redact  # noqa: E402

import _warm as warm
from _mlflow_util import MlflowServer, tiny_model, train  # noqa: E402
from wandb_reader import read_run, settled_runs  # noqa: E402

GH = "ghp_" + "Z9" * 18
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlLXZhbHVl"
#: secret marker -> where it hides
SECRETS = {
    "S3cr3t-apikey": "api_key", "S3cr3t-password": "password", "S3cr3t-token": "token",
    "0123456789abcdef0123456789abcdef0123beef": "WANDB_API_KEY", "S3cr3t-dbpass": "db.Password",
    "S3cr3t-aws": "aws_secret_access_key", "S3cr3t-passwd": "passwd", "S3cr3t-urlpass": "db.url userinfo",
    "S3cr3t-bearer1": "Authorization header", GH: "GitHub token under an innocent key",
    "UzNjcjN0LWJhc2lj": "Basic credentials", "S3cr3t-conn": "Password= in a connection string",
    "S3cr3t-vault": "user key pattern", "corp-4242-S3cr3t": "user value pattern", JWT: "JWT",
    "S3cr3t-runname": "token= in the run name", "AKIAABCDEFGHIJKLMNOP": "AWS access key id",
}


def _hparams() -> dict[str, Any]:
    return {
        "lr": 0.05, "pad_token": "<pad>", "api_key": "S3cr3t-apikey", "password": "S3cr3t-password",
        "token": "S3cr3t-token", "WANDB_API_KEY": "0123456789abcdef0123456789abcdef0123beef",
        "db": {"Password": "S3cr3t-dbpass", "host": "db.example", "url": "postgresql://alice:S3cr3t-urlpass@db.example/x"},
        "aws_secret_access_key": "S3cr3t-aws", "passwd": "S3cr3t-passwd",
        "headers": ["Authorization: Bearer S3cr3t-bearer1", "Accept: json"], "remote": f"https://{GH}@github.com/o/r",
        "proxy_header": "Basic UzNjcjN0LWJhc2lj", "dsn": "Server=db;User Id=bob;Password=S3cr3t-conn;",
        "vault_path": "S3cr3t-vault", "note": "ticket corp-4242-S3cr3t", "jwt_in_text": f"cookie {JWT}",
        "aws": {"id": "AKIAABCDEFGHIJKLMNOP"},
    }


def _leaks(text: str) -> list[str]:
    return [f"{m} ({where})" for m, where in SECRETS.items() if m in text]


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var, sub in (("WANDB_DIR", "wandb_env"), ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_CACHE_DIR", "wandb_cache")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_no_secret_reaches_any_sink_or_file(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    model, opt = tiny_model()
    with caplog.at_level(logging.INFO, logger="trackdiag"):
        diag = trackdiag.Diagnostics(
            model, opt, level="advanced", sinks=["console", "mlflow", "wandb"], output_dir=str(tmp_path / "run"),
            run_name="exp-token=S3cr3t-runname", hparams=_hparams(),
            redact={"keys": ["vault"], "patterns": [r"corp-\d{4}-\w+"]},
            probes={"report": {"enabled": False}},
            sink={"mlflow": {"tracking_uri": store, "experiment": "redact"},
                  "wandb": {"mode": "offline", "dir": str(tmp_path), "project": "p",
                            "settings": {"console": "off", "x_disable_stats": True, "x_save_requirements": False}}})
        with diag:
            train(diag, model, opt, range(12))
    run_id = next(s for s in diag._hub.sinks if isinstance(s, MlflowSink)).run_id
    wandb_files = settled_runs(tmp_path)

    # every byte on disk: local record, MLflow database and artifacts, W&B transaction log
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 10 and wandb_files
    leaks = {str(p.relative_to(tmp_path)): found for p in files
             if (found := _leaks(p.read_bytes().decode("latin-1")))}
    assert leaks == {}
    console = capsys.readouterr()
    assert _leaks(console.out + console.err) == [] and "run=exp-token=redacted" in console.err
    assert _leaks("\n".join(r.getMessage() for r in caplog.records)) == []

    # ...and what is not secret is still there, readably
    local = json.loads((tmp_path / "run" / "run.json").read_text())["hparams"]
    assert local["lr"] == 0.05 and local["pad_token"] == "<pad>" and local["db"]["host"] == "db.example"
    assert local["db"]["url"] == f"postgresql://alice:{MASK}@db.example/x" and local["api_key"] == MASK
    assert local["headers"] == [f"Authorization: {MASK}", "Accept: json"]
    client = MlflowClient(store)
    params = client.get_run(run_id).data.params
    assert params["lr"] == "0.05" and params["db.Password"] == MASK and params["vault_path"] == MASK
    config = yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / "dl"))).read_text())
    assert config["db"]["host"] == "db.example" and config["password"] == MASK
    wb = read_run(wandb_files[0])
    assert wb.config["lr"] == 0.05 and wb.config["WANDB_API_KEY"] == MASK and wb.config["remote"] == \
        f"https://{MASK}@github.com/o/r"
    assert wb.run["name"] == "exp-token=redacted" and wb.summary["trackdiag/status"] == "FINISHED"


def test_policy_by_key_and_by_shape() -> None:
    p = RedactPolicy()
    for key in ("password", "PASSWD", "passphrase", "apiKey", "API-KEY", "x_api_key", "WANDB_API_KEY", "authToken",
                "hf_token", "client_secret", "aws_secret_access_key", "private_key", "Authorization", "credentials",
                "session_key", "cookie", "pgpassword"):
        assert p.secret_key(key), key
    for key in ("lr", "pad_token", "bos_token", "max_tokens", "tokenizer", "author", "keys", "monkey", "num_passes",
                "sort_key", "token_budget", "bypass"):
        assert not p.secret_key(key), key
    assert p.text("postgres://u:pw@h:5/db") == f"postgres://u:{MASK}@h:5/db"
    assert p.text("Bearer abc.def-123") == f"Bearer {MASK}" and p.text("a basic training loop") == "a basic training loop"
    assert p.text("https://h/x?user=a&access_token=t0k3n&page=2") == f"https://h/x?user=a&access_token={MASK}&page=2"
    assert p.text("sk-proj-" + "a1" * 12) == MASK and p.text("xoxb-1234567890-abc") == MASK
    assert p.text("-----BEGIN RSA PRIVATE KEY-----\nMIIB\n-----END RSA PRIVATE KEY-----") == MASK
    # long hex/base64 only counts under a weakly suspicious key
    opaque = "f" * 20 + "0" * 20
    assert p.redact({"key": opaque, "commit": opaque, "api_key": None, "use_auth": True}) == \
        {"key": MASK, "commit": opaque, "api_key": None, "use_auth": True}
    assert RedactPolicy(keys=(r"db\.host",)).redact({"db": {"host": "h", "port": 1}}) == {"db": {"host": MASK, "port": 1}}
    assert RedactPolicy(enabled=False).redact({"password": "x"}) == {"password": "x"}
    assert redact_override("+db.password=x") == f"+db.password={MASK}" and redact_override("lr=0.1") == "lr=0.1"


def test_wandb_sink_redaction_is_the_shared_policy_plus_its_words() -> None:
    cfg = {"url": "https://u:pw@h", "password": "x", "my_thing": "y"}
    assert wandb_redact(cfg) == {"url": f"https://u:{MASK}@h", "password": MASK, "my_thing": "y"}
    assert wandb_redact(cfg, ["thing"])["my_thing"] == MASK


def test_redact_section_is_validated_and_can_be_switched_off(tmp_path: Path) -> None:
    model, opt = tiny_model()
    with pytest.raises(ConfigError) as info:
        trackdiag.Diagnostics(model, opt, output_dir=str(tmp_path), redact={"keys": ["("], "patterns": [".*"], "x": 1})
    assert len(info.value.problems) == 3
    run = RunInfo("r", tmp_path, "basic", {"redact": {"enabled": False}}, {"password": "visible"})
    assert run.hparams == {"password": "visible"}


@pytest.mark.slow
def test_credentials_in_the_tracking_uri_connect_but_are_never_written(tmp_path: Path,
                                                                      mlflow_server: MlflowServer) -> None:
    """The real tracking URI (with user:password) is what the MLflow sink connects with; the run's
    record, the diag config artifact and the server's own files (but its database, which holds the masked URI's
    run) only ever hold the masked one."""
    server = mlflow_server
    uri = server.uri.replace("http://", "http://alice:S3cr3t-uri@")
    model, opt = tiny_model()
    with trackdiag.Diagnostics(model, opt, level="basic", every=2, sinks=["mlflow"], output_dir=str(tmp_path / "run"),
                               sink={"mlflow": {"tracking_uri": uri, "experiment": "creds"}}) as diag:
        train(diag, model, opt, range(6))
    sink = next(s for s in diag._hub.sinks if isinstance(s, MlflowSink))
    assert sink.tracking_uri == uri and sink.run_id  # connected with the real credentials
    client = MlflowClient(server.uri)
    assert [m.step for m in client.get_metric_history(sink.run_id, "diag/loss")] == list(range(6))
    diag_cfg = Path(client.download_artifacts(sink.run_id, "trackdiag/diag_config.yaml", str(tmp_path / "dl")))
    assert "alice:" + MASK in diag_cfg.read_text()
    served = [p for p in server.root.rglob("*") if p.is_file() and sink.run_id in str(p)]
    assert served  # the run's artifacts on the server
    written = [p for p in [*tmp_path.rglob("*"), *server.root.rglob("*")] if p.is_file() and p.name != "server.db"]
    assert written and not [p for p in written if b"S3cr3t-uri" in p.read_bytes()]


@pytest.mark.slow
def test_hydra_app_secrets_in_config_and_overrides(tmp_path: Path) -> None:
    """The documented ``hparams=cfg`` in a real Hydra app (installed package, default MLflow sink):
    secrets in the config and on the command line reach neither the run name, the local record,
    MLflow's store nor the console. Hydra's own ``.hydra/`` files are Hydra's, not trackdiag's."""
    import os
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    app = tmp_path / "app"
    shutil.copytree(repo / "examples", app)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    proc = warm.run(
        [sys.executable, "train.py", "+diag=basic", "steps=30", "+db.password=S3cr3t-hydra1",
         "+api_key=S3cr3t-hydra2", "+data.url=s3://bob:S3cr3t-hydra3@bucket/x", f"hydra.run.dir={tmp_path / 'out'}"],
        cwd=app, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "S3cr3t" not in proc.stdout + proc.stderr
    run = json.loads((tmp_path / "out" / "diag" / "run.json").read_text())
    assert run["name"].startswith("train-") and "db.password=redacted" in run["name"]
    assert run["hparams"]["db"]["password"] == MASK and run["hparams"]["data"]["url"] == f"s3://bob:{MASK}@bucket/x"
    written = [p for p in tmp_path.rglob("*") if p.is_file() and ".hydra" not in p.parts]
    assert (app / "mlflow.db") in written
    assert [str(p) for p in written if b"S3cr3t" in p.read_bytes()] == []


def test_log_messages_are_masked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tracking URI with credentials that cannot be reached: the sink's warning names it, masked."""
    from _mlflow_util import free_port

    uri = f"http://alice:S3cr3t-log@127.0.0.1:{free_port()}"
    model, opt = tiny_model()
    with caplog.at_level(logging.INFO, logger="trackdiag"):
        with trackdiag.Diagnostics(model, opt, level="basic", every=2, sinks=["mlflow"], output_dir=str(tmp_path / "r"),
                                   probes={"report": {"enabled": False}},
                                   sink={"mlflow": {"tracking_uri": uri, "close_timeout": 1.0, "retry_backoff": 0.2,
                                                    "delivery": "thread"}}) as diag:
            train(diag, model, opt, range(4))
    messages = [r.getMessage() for r in caplog.records]
    assert any("unreachable" in m and f"alice:{MASK}@127.0.0.1" in m for m in messages), messages
    assert not [m for m in messages if "S3cr3t-log" in m]
