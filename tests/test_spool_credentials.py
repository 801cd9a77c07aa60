"""A tracking URI's credentials never reach a spool on disk or a child's command line, and a
spool made against such a store is still delivered (the URI is given again)."""
from __future__ import annotations

import json

from trackdiag.sinks.mlflow.spool import Spool, masked_state, real_uri


def test_spool_meta_masks_the_password_and_recovers_it(tmp_path, monkeypatch) -> None:
    uri = "http://alice:s3cr3t-pass@127.0.0.1:5999"
    spool = Spool(tmp_path / "mlflow_spool", owner=True)
    spool.dir.mkdir(parents=True)
    spool.write_meta({"tracking_uri": uri, "run_id": "abc"})
    text = (spool.dir / "meta.json").read_text()
    assert "s3cr3t-pass" not in text and "alice" in text
    stored = json.loads(text)["state"]["tracking_uri"]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert real_uri(stored, None) is None  # the credentials are needed and not known
    assert real_uri(stored, uri) == uri  # given again: the same store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert real_uri(stored, None) == uri  # or from the environment
    # another store given: not the recorded one (sync then makes a new run there); the recorded store's
    # real URI still comes from the environment
    assert real_uri(stored, "http://127.0.0.1:6000") == uri
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert real_uri(stored, "http://127.0.0.1:6000") is None
    plain = "sqlite:////tmp/x/mlflow.db"
    assert masked_state({"tracking_uri": plain}) == {"tracking_uri": plain} and real_uri(plain, None) == plain
