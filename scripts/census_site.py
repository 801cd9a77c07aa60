"""Per-process CPU census for scripts/suite_cpu.sh (``CENSUS=1``): installed as a ``.pth`` line in the venv for one
run, it makes every Python process of that venv append, at exit, a line to ``$TRACKDIAG_CENSUS``:
``test<TAB>own CPU-s<TAB>waited children's CPU-s<TAB>wall-s<TAB>pid<TAB>argv`` (``test``: the
``PYTEST_CURRENT_TEST`` it inherited, ``-`` for none). It attributes the MLflow sink's workers, sweep jobs and
end-to-end apps to the test that started them; processes killed by a signal write nothing (``ACCT=1``: the kernel's
process accounting counts those, and ``$TRACKDIAG_CENSUS_START`` gets a line as each process starts,
``pid<TAB>ppid<TAB>test<TAB>command line``, read by ``scripts/acct_report.py``)."""
import os

if os.environ.get("TRACKDIAG_CENSUS_START"):
    try:  # the whole command line: a .pth line runs before ``-m``'s module name reaches sys.argv
        with open("/proc/self/cmdline", "rb") as _f:
            _cmd = " ".join(a.decode(errors="replace") for a in _f.read().split(b"\0")[1:] if a)
        with open(os.environ["TRACKDIAG_CENSUS_START"], "a") as _f:
            _f.write(f"{os.getpid()}\t{os.getppid()}\t{os.environ.get('PYTEST_CURRENT_TEST', '-').split(' ')[0]}\t"
                     f"{_cmd[:200].replace(chr(9), ' ').replace(chr(10), ' ')}\n")
    except Exception:  # noqa: BLE001 - a census must never change how a process starts
        pass

if os.environ.get("TRACKDIAG_CENSUS"):
    import atexit
    import sys
    import time

    _t0 = time.time()

    def _line() -> None:
        try:
            t = os.times()
            test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
            argv = " ".join(sys.argv)[:150].replace("\t", " ").replace("\n", " ")
            with open(os.environ["TRACKDIAG_CENSUS"], "a") as f:
                f.write(f"{test}\t{t.user + t.system:.2f}\t{t.children_user + t.children_system:.2f}\t"
                        f"{time.time() - _t0:.1f}\t{os.getpid()}\t{argv}\n")
        except Exception:  # noqa: BLE001 - a census must never change how a process exits
            pass

    atexit.register(_line)
