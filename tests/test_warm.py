"""``tests/_warm.py``: a child forked from the warm zygote is the process ``python ...`` would have started. Each
case runs the same command cold (``subprocess``) and warm and compares what the child saw and did: ``sys.argv``,
``sys.path``, ``__main__``, working directory, environment, streams, stdin, exit status, session."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import _warm as warm

PROBE = textwrap.dedent("""
    import json, os, sys
    import torch
    import __main__
    line = sys.stdin.readline() if "stdin" in sys.argv else ""
    print(json.dumps({"argv": sys.argv, "path": sys.path, "name": __name__, "file": globals().get("__file__"),
                      "main_is_globals": vars(__main__) is globals(), "cwd": os.getcwd(), "mark": os.environ.get("TD_MARK"),
                      "has_hydra_in_env": "HYDRA_FULL_ERROR" in os.environ, "stdin": line,
                      "session_leader": os.getsid(0) == os.getpid(), "threads": torch.get_num_threads()}), flush=True)
    print("to stderr", file=sys.stderr)
    if "raise" in sys.argv:
        raise ValueError("planted")
    if "kill" in sys.argv:
        os.kill(os.getpid(), 9)
    sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 0)
""")


def both(tmp_path: Path, args: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    cmd = [sys.executable, *args]
    assert warm.warmable(cmd, kwargs)
    cold = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    hot = warm.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    return cold, hot


@pytest.mark.parametrize("tail", [["0"], ["3"], ["raise"], ["kill"]])
def test_a_script_sees_and_does_what_a_cold_one_does(tmp_path: Path, tail: list[str]) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "probe.py").write_text(PROBE)
    env = {**os.environ, "TD_MARK": "m1", "PYTHONPATH": str(tmp_path / "lib")}
    cold, hot = both(tmp_path, ["app/probe.py", *tail], cwd=tmp_path, env=env)
    assert hot.returncode == cold.returncode == {"0": 0, "3": 3, "raise": 1, "kill": -9}[tail[0]]
    assert json.loads(hot.stdout) == json.loads(cold.stdout)
    seen = json.loads(hot.stdout)
    assert seen["path"][:2] == [str(tmp_path / "app"), str(tmp_path / "lib")] and seen["mark"] == "m1"
    assert seen["main_is_globals"] and seen["name"] == "__main__" and seen["file"] == str(tmp_path / "app" / "probe.py")
    assert hot.stderr.startswith("to stderr")
    if tail == ["raise"]:
        assert hot.stderr.rstrip().endswith("ValueError: planted") and "app/probe.py" in hot.stderr


def test_dash_c_dash_m_stdin_and_a_new_session(tmp_path: Path) -> None:
    (tmp_path / "probe_mod.py").write_text(PROBE)
    cold, hot = both(tmp_path, ["-c", PROBE, "stdin"], cwd=tmp_path, input="hello\n")
    assert hot.returncode == cold.returncode == 0 and json.loads(hot.stdout) == json.loads(cold.stdout)
    assert json.loads(hot.stdout)["stdin"] == "hello\n" and json.loads(hot.stdout)["argv"] == ["-c", "stdin"]
    cold, hot = both(tmp_path, ["-m", "probe_mod", "5"], cwd=tmp_path)
    assert hot.returncode == cold.returncode == 5 and json.loads(hot.stdout) == json.loads(cold.stdout)
    cold, hot = both(tmp_path, ["missing.py"], cwd=tmp_path)
    assert hot.returncode == cold.returncode == 2 and hot.stderr == cold.stderr and "can't open file" in hot.stderr
    cold, hot = both(tmp_path, ["-c", PROBE], cwd=tmp_path, start_new_session=True)
    assert json.loads(hot.stdout) == json.loads(cold.stdout) and json.loads(hot.stdout)["session_leader"]


def test_import_time_environment_gets_its_own_zygote_and_popen_waits_and_kills(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    cold, hot = both(tmp_path, ["probe.py"], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert json.loads(hot.stdout)["threads"] == json.loads(cold.stdout)["threads"] == 2
    cold, hot = both(tmp_path, ["probe.py"], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert json.loads(hot.stdout)["threads"] == json.loads(cold.stdout)["threads"] == 1
    proc = warm.popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    assert isinstance(proc, warm.Popen) and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM


def test_what_is_not_python_running_a_file_starts_cold() -> None:
    assert not warm.warmable(["bash", "-c", "true"], {})
    assert not warm.warmable([sys.executable, "-X", "importtime", "-c", "pass"], {})
    assert not warm.warmable([sys.executable, "x.py"], {"preexec_fn": print})
    assert not warm.warmable([sys.executable, "-c", "pass"], {"preexec_fn": print})
    plain = warm.popen(["true"])
    assert isinstance(plain, subprocess.Popen) and plain.wait(30) == 0
