"""``import trackdiag`` and the command line start without torch (issue 47 item 7: the suite's and the users'
start-up): the session is loaded on first use, and ``trackdiag summary`` / ``compare`` read records only.

Each check runs in a fresh interpreter (this one imported torch long ago)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> dict:
    """Run ``code`` in a new Python with this checkout first on the path; it prints one JSON line."""
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n{code}"],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_and_cli_without_torch_then_the_session_on_first_use() -> None:
    got = _fresh("""
import json
import trackdiag, trackdiag.cli, trackdiag.compare, trackdiag.hydra_callback
before = "torch" in sys.modules
names = sorted(dir(trackdiag))
from trackdiag import Diagnostics
from trackdiag.session.diagnostics import Diagnostics as Real
print(json.dumps({"torch_before": before, "torch_after": "torch" in sys.modules, "same": Diagnostics is Real,
                  "cached": "Diagnostics" in vars(trackdiag), "listed": [n for n in trackdiag.__all__ if n not in names],
                  "pre": trackdiag.PreflightReport.__module__, "off": trackdiag.DisabledDiagnostics.__module__}))
""")
    assert got == {"torch_before": False, "torch_after": True, "same": True, "cached": True, "listed": [],
                   "pre": "trackdiag.forensics.preflight", "off": "trackdiag.session.disabled"}


def test_star_import_and_an_unknown_name() -> None:
    got = _fresh("""
import json
ns = {}
exec("from trackdiag import *", ns)
import trackdiag
try:
    trackdiag.NoSuchThing
    err = None
except AttributeError as exc:
    err = str(exc)
print(json.dumps({"star": sorted(k for k in ns if not k.startswith("__")), "err": err}))
""")
    import trackdiag

    assert got["star"] == sorted(n for n in trackdiag.__all__ if n != "__version__")
    assert got["err"] == "module 'trackdiag' has no attribute 'NoSuchThing'"


def test_landscape_command_offers_exactly_the_losses_it_can_compute() -> None:
    from trackdiag.cli.landscape import LOSS_NAMES
    from trackdiag.forensics.landscape import LOSSES

    assert LOSS_NAMES == tuple(LOSSES)


@pytest.mark.parametrize("command", [["summary"], ["compare"]])
def test_summary_and_compare_of_a_run_do_not_import_torch(tmp_path: Path, command: list[str]) -> None:
    """A finished run's record read back by the command line, in a process that never imports torch."""
    import torch

    import trackdiag

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], output_dir=str(tmp_path / "run"),
                               probes={"report": {"enabled": False}}) as diag:
        for _ in range(5):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss)
    got = _fresh(f"""
import json, io, contextlib
from trackdiag.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main({[*command, str(tmp_path / "run")]!r})
print(json.dumps({{"rc": rc, "torch": "torch" in sys.modules, "out": out.getvalue()}}))
""")
    assert got["rc"] in (0, None) and got["torch"] is False, got
    assert ("5 steps" in got["out"]) if command == ["summary"] else ("1 run" in got["out"]), got["out"]
