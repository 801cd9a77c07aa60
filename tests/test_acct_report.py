"""``scripts/acct_report.py`` reads the kernel's process accounting (``struct acct_v3``) as the kernel writes it: a real
file written by ``acct(2)`` when this machine allows it (root), and records packed by hand for the ``comp_t`` encoding
(13-bit mantissa, base-8 exponent) of CPU times too long for the mantissa alone."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import acct_report  # noqa: E402


def _record(pid: int, ppid: int, comm: bytes, utime: int, stime: int, etime: float, exitcode: int = 0) -> bytes:
    return acct_report.RECORD.pack(0, 3, 0, exitcode, 0, 0, pid, ppid, 0, etime, utime, stime, 0, 0, 0, 0, 0, 0, comm)


def test_comp_t_and_records_packed_by_hand(tmp_path: Path) -> None:
    assert acct_report.comp_t(100) == 100
    assert acct_report.comp_t((2 << 13) | 1000) == 1000 * 64  # exponent 2: x 8**2
    (tmp_path / "pacct").write_bytes(_record(10, 1, b"postgres", 250, 50, 1200.0, 9)
                                     + _record(11, 10, b"python", (1 << 13) | 5000, 0, 300.0))
    (tmp_path / "starts.tsv").write_text("11\t10\ttests/test_x.py::test_y\t-m mlflow server --port 1\n")
    procs = acct_report.read_pacct(tmp_path / "pacct")
    assert procs == [acct_report.Proc(10, 1, "postgres", 3.0, 12.0, 9), acct_report.Proc(11, 10, "python", 400.0, 3.0, 0)]
    names = acct_report.read_names(tmp_path)
    assert acct_report.kind(procs[1], names) == "python mlflow server"
    assert acct_report.kind(procs[0], names) == "postgres"


def test_a_real_accounting_file(tmp_path: Path) -> None:
    if os.environ.get("TRACKDIAG_CENSUS_START"):
        pytest.skip("the suite's own accounting is on (ACCT=1): one file at a time, and this test would end it")
    libc = ctypes.CDLL(None, use_errno=True)
    path = tmp_path / "pacct"
    path.touch()
    if os.geteuid() != 0 or libc.acct(str(path).encode()) != 0:
        pytest.skip("process accounting needs root and CONFIG_BSD_PROCESS_ACCT")
    try:
        child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                                  "while time.process_time() - t < 0.3: pass"])
        child.wait(30)
        time.sleep(0.2)
    finally:
        libc.acct(None)
    mine = [p for p in acct_report.read_pacct(path) if p.pid == child.pid]
    assert len(mine) == 1 and mine[0].ppid == os.getpid() and mine[0].exit == 0
    assert 0.25 <= mine[0].cpu <= 1.5, mine[0]  # the 0.3 s it spun, plus its start
