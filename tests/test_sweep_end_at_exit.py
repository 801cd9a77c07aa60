"""The end of a sweep run from the launcher's ``atexit`` handler (Hydra skips ``on_multirun_end`` after a failed or
killed job): thread pools are refused then ("cannot schedule new futures after interpreter shutdown").

Found by test_sweep_ray (its flake, 1 run in 4): the killed job's child run existed when the sweep was settled, so
its missing points were read back with a thread pool, which raised at the launcher's exit; the sweep's parent run
was left RUNNING and the comparison unlogged. Here: the same call, ``complete_from_record``, in an ``atexit`` handler
of a real process against a real SQLite store, and :func:`trackdiag.util.pool.thread_map` itself.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trackdiag.util.pool import thread_map

REPO = Path(__file__).resolve().parents[1]


def _at_exit(tmp_path: Path, body: str, preload: bool = True) -> dict:
    """Run ``body`` (which sets ``result``) in an atexit handler of a fresh interpreter; its result or error.
    ``preload``: the thread pool module imported before the exit, as MLflow and Ray do in a launcher."""
    script = tmp_path / "at_exit.py"
    script.write_text(textwrap.dedent("""
        import atexit, json, sys, traceback
        {preload}
        sys.path.insert(0, {repo!r})
        def end():
            out = {{}}
            try:
        {body}
                out["result"] = result
            except BaseException as e:
                out["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
            open({out!r}, "w").write(json.dumps(out))
        atexit.register(end)
    """).format(repo=str(REPO), out=str(tmp_path / "out.json"), preload="import concurrent.futures.thread" if preload else "",
                body=textwrap.indent(textwrap.dedent(body), " " * 8)))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((tmp_path / "out.json").read_text())


def test_thread_map_keeps_order_and_raises_the_first_failure() -> None:
    assert list(thread_map(lambda x: x * x, range(20), 4)) == [x * x for x in range(20)]
    assert list(thread_map(str, [], 4)) == []

    def fail(x: int) -> int:
        if x == 3:
            raise ValueError("three")
        return x

    with pytest.raises(ValueError, match="three"):
        list(thread_map(fail, range(8), 4))


def test_thread_map_works_in_an_atexit_handler(tmp_path) -> None:
    got = _at_exit(tmp_path, """
        from concurrent.futures import ThreadPoolExecutor
        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(abs, [-1, -2]))
            refused = False
        except RuntimeError:
            refused = True
        from trackdiag.util.pool import thread_map
        result = [refused, list(thread_map(lambda x: x + 1, range(6), 4))]
    """)
    assert got.get("result") == [True, [1, 2, 3, 4, 5, 6]], got  # a plain pool is refused there; thread_map is not


def test_thread_map_works_at_exit_when_the_pool_module_was_never_imported(tmp_path) -> None:
    got = _at_exit(tmp_path, """
        fresh = "concurrent.futures.thread" not in sys.modules
        from trackdiag.util.pool import thread_map
        result = [fresh, list(thread_map(lambda x: 2 * x, range(4), 4))]
    """, preload=False)
    assert got.get("result") == [True, [0, 2, 4, 6]], got


@pytest.mark.slow
def test_a_killed_jobs_points_are_completed_at_the_launchers_exit(tmp_path) -> None:
    """``complete_from_record`` (settle: a killed job's run completed from its local record) at interpreter exit."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from trackdiag.core.record import Record

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("sweep")).info.run_id
    client.log_batch(run_id, metrics=[Metric("diag/loss", 1.0 / (s + 1), 1000 + s, s) for s in range(5)])
    run_dir = tmp_path / "job8" / "diag"
    run_dir.mkdir(parents=True)
    with open(run_dir / "records.jsonl", "w", encoding="utf-8") as f:  # the job got to step 11; 5 points delivered
        for s in range(12):
            f.write(Record(step=s, time=1.0 + s, scalars={"diag/loss": 1.0 / (s + 1), "diag/grad/norm": 2.0}).to_json()
                    + "\n")
    got = _at_exit(tmp_path, f"""
        from mlflow import MlflowClient
        from trackdiag.hydra.sweep_mlflow import complete_from_record
        result = complete_from_record(MlflowClient({uri!r}), {run_id!r}, __import__("pathlib").Path({str(run_dir)!r}))
    """)
    assert got.get("result") == 7 + 12, got  # 7 losses and 12 gradient norms the run lacked
    assert [m.step for m in sorted(client.get_metric_history(run_id, "diag/loss"), key=lambda m: m.step)] == list(range(12))
    assert len(client.get_metric_history(run_id, "diag/grad/norm")) == 12
