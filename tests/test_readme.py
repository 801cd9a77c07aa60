"""Every shell command and Python snippet of the README works as printed, after its two set-up commands.

The README is read as a user reads it: each ```python block starts with ``# <name>.py`` and is saved
under that name; each ```bash block's lines are commands (comments stripped) run, in order, by
``bash`` in one fresh directory that holds only ``.venv``, ``examples`` and ``scripts`` of this
checkout (links), with no PYTHONPATH, no MLFLOW_TRACKING_URI and no activated environment (PATH
without the venv). The two set-up lines (``bash scripts/bootstrap.sh && X``) have already run: their
``X`` part runs, except the test suite itself. A command that serves (``mlflow ui``) is started on
a free port and must answer ``/health``; everything else must exit 0. W&B is offline, Hugging Face
offline. Each ``## `` section runs in a directory of its own (one test each, so they run in parallel).
``-m "not slow"`` skips them: together they train a dozen small runs."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from _mlflow_util import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 250


def blocks(text: str | None = None) -> list[tuple[str, str]]:
    """The fenced blocks of ``text`` (the README) as (language, body), in order."""
    text = README.read_text(encoding="utf-8") if text is None else text
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def sections() -> dict[str, str]:
    """The README's ``## `` sections: heading -> text (each one's commands run in a fresh directory)."""
    parts = re.split(r"^## (.+)$", README.read_text(encoding="utf-8"), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def steps(text: str | None = None) -> list[tuple[str, str]]:
    """("file", name + "\\n" + body) for each Python block, ("run", command) for each bash line."""
    out: list[tuple[str, str]] = []
    for lang, body in blocks(text):
        if lang == "python":
            first = body.split("\n", 1)[0]
            name = re.match(r"# ([\w.-]+\.py)\b", first)
            assert name, f"a README Python block must start with '# <name>.py': {first!r}"
            out.append(("file", f"{name.group(1)}\n{body}"))
        elif lang == "bash":
            for line in body.splitlines():
                command = re.sub(r"\s+#\s.*$", "", line).strip()
                if command.startswith("bash scripts/bootstrap.sh && "):
                    command = command.split("&& ", 1)[1]
                    if " -m pytest" in command:
                        continue  # the suite itself: this test is part of it
                if command:
                    out.append(("run", command))
    return out


RUNNABLE = [h for h, body in sections().items() if any(k == "run" for k, _ in steps(body))]


def test_readme_is_short_and_its_snippets_are_complete() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_LINES
    assert not re.search(r"\bissue \d+|this round|before this", text, re.I)  # no project history
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (REPO / target).exists(), target
    kinds = [k for k, _ in steps()]
    assert kinds.count("file") >= 5 and kinds.count("run") >= 8
    for kind, body in steps():  # every snippet file is run by a command; every command names the venv
        if kind == "file":
            name = body.split("\n", 1)[0]
            assert any(k == "run" and name in c.split() for k, c in steps()), f"{name} is never run"
        else:
            assert body.startswith((".venv/bin/", "bash ")), body


def _serve(command: str, cwd: Path, env: dict[str, str]) -> None:
    """A command that serves until stopped: start it on a free port, wait for /health, stop it."""
    port = free_port()
    proc = subprocess.Popen(f"{command} --host 127.0.0.1 --port {port}", shell=True, cwd=cwd, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            assert proc.poll() is None, proc.stderr.read()[-2000:]  # type: ignore[union-attr]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"{command} did not answer on port {port}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("section", RUNNABLE, ids=[re.sub(r"\W+", "-", h.lower()).strip("-") for h in RUNNABLE])
def test_every_command_and_snippet_works_as_printed(tmp_path: Path, section: str) -> None:
    """Each section's commands, in order, in a fresh directory of their own (sections do not share files)."""
    work = tmp_path / "fresh"
    work.mkdir()
    for name in (".venv", "examples", "scripts"):
        (work / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI", "VIRTUAL_ENV") and not k.startswith("PYTEST")}
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", WANDB_MODE="offline", WANDB_SILENT="true", HF_HUB_OFFLINE="1",
               MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", HOME=str(tmp_path))
    ran = []
    for kind, body in steps(sections()[section]):
        if kind == "file":
            name, text = body.split("\n", 1)
            (work / name).write_text(text, encoding="utf-8")
            continue
        if " mlflow ui" in body:
            assert (work / "mlflow.db").exists(), "mlflow ui before anything wrote ./mlflow.db"
            _serve(body, work, env)
            ran.append(body)
            continue
        done = subprocess.run(["bash", "-c", body], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"README command failed: {body}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        ran.append(body)
        if "quickstart.py" in body:  # a plain-Python session says where its results are and how to look
            assert re.search(r"^  results: .*trackdiag_runs", done.stderr, re.M), done.stderr[-2000:]
            assert "to look again: " in done.stderr and "start the UI first: " in done.stderr, done.stderr[-2000:]
        if " -m +diag=" in body:  # a sweep: its comparison beside it
            sweep = re.search(r"hydra\.sweep\.dir=(\S+)", body)
            assert sweep and (work / sweep.group(1) / "comparison.html").exists(), body
    assert ran


def test_every_runnable_section_is_tested() -> None:
    """The README's commands are all in some section (none before the first heading)."""
    head = README.read_text(encoding="utf-8").split("\n## ", 1)[0]
    assert not [k for k, _ in steps(head) if k == "run"]
    assert sum(len([k for k, _ in steps(sections()[h]) if k == "run"]) for h in RUNNABLE) == \
        len([k for k, _ in steps() if k == "run"]) >= 8
