"""The MLflow run's story: its description (the ``mlflow.note.content`` tag) and the link to its page.

The MLflow 3 run page renders a run's note as markdown at the top of its Overview ("Description",
a few lines shown before "Show more"); the runs table can show it as the "Description" column.
:func:`run_note` writes there what a user looks for first: the health, then one line per alert
kind (its first step, ``where``, message and hint), and a link to ``report.html`` in the run's
Artifacts tab. The link needs the run's experiment and run ids, which exist only once the
delivery worker has made the run (and differ when ``trackdiag sync`` delivers to another store):
the note carries :data:`RUN_HREF` and the runner fills it in (:func:`fill_note`) just before the
``log_batch`` that sends it.

:func:`run_url` is the link printed at the end of a run: the run itself, in the UI's
"Model training" view (``?workflowType=machine_learning``). A fresh browser opens MLflow 3.17 in
its GenAI view whatever the experiment's ``mlflow.experimentKind`` tag says; the query parameter
overrides the browser's saved choice for that page. Costs: string work only, O(alert kinds).
"""
from __future__ import annotations

import re
from typing import Any

NOTE_TAG = "mlflow.note.content"
MARK = "**trackdiag"  # a note that starts so is trackdiag's own: rewritten; any other note is the user's
RUN_HREF = "{trackdiag:run_href}"  # filled in by the runner with "#/experiments/<eid>/runs/<rid>"
VIEW = "workflowType=machine_learning"  # the MLflow UI's "Model training" view
UI_PORT = 5000  # `mlflow ui`'s default port
MAX_NOTE = 7000  # MLflow tag values hold at most 8000 characters
MAX_KINDS = 12
_RANK = {"info": 0, "warning": 1, "critical": 2}


def _one_line(text: Any, limit: int) -> str:
    """``text`` on one line, markdown's active characters neutralised, cut to ``limit`` characters."""
    flat = re.sub(r"\s+", " ", str(text or "")).strip()
    flat = re.sub(r"([\\`*_\[\]|#])", r"\\\1", flat).replace("<", "&lt;").replace(">", "&gt;")
    if len(flat) <= limit:
        return flat
    return re.sub(r"(\\|&[a-z]{0,3})$", "", flat[: limit - 1]) + "…"  # no escape or entity cut in half


def _code(text: Any) -> str:
    """``where`` as inline code (backticks inside become quotes)."""
    return "`" + str(text).replace("`", "'")[:120] + "`"


def run_note(health: str, status: str | None, steps: int | None, kinds: dict[str, dict[str, Any]],
             report: str | None) -> str:
    """The run's description (markdown). ``kinds``: alert kind -> ``{"count", "severity",
    "first": Alert.to_dict() of its first alert}``; ``status`` None while the run goes on (``steps``
    is then the latest step seen); ``report``: the artifact path of ``report.html`` to link (when
    the preset wrote one). Kinds are listed worst first, then by first step; at most
    :data:`MAX_KINDS`, the note at most :data:`MAX_NOTE` characters."""
    head = f"{MARK}: health {health.upper()}**"
    if status is None:
        head += f" · running (step {steps})" if steps is not None else " · running"
    else:
        head += f" · run {status}" + (f" after {steps} steps" if steps is not None else "")
    head += f" · {len(kinds)} alert kind{'s' if len(kinds) != 1 else ''}" if kinds else " · no alerts"
    if report:
        head += f" · [report.html]({RUN_HREF}/artifacts/{report}?{VIEW})"
    order = sorted(kinds, key=lambda k: (-_RANK.get(str(kinds[k].get("severity")), 0),
                                         int((kinds[k].get("first") or {}).get("step", 0)), k))
    lines = [head, ""]
    for kind in order[:MAX_KINDS]:
        info = kinds[kind]
        first = info.get("first") or {}
        where = f" in {_code(first['where'])}" if first.get("where") else ""
        count = int(info.get("count") or 1)
        line = (f"- **{_one_line(kind, 60)}** ({_one_line(info.get('severity', first.get('severity', '')), 10)}) "
                f"at step {first.get('step', '?')}{where}: {_one_line(first.get('message', ''), 300)}")
        if first.get("hint"):
            line += f" *Hint:* {_one_line(first['hint'], 400)}"
        if count > 1:
            line += f" ({count} alerts)"
        lines.append(line)
    if len(order) > MAX_KINDS:
        lines.append(f"- … and {len(order) - MAX_KINDS} more kinds (alerts.json)")
    text = "\n".join(lines).rstrip() + "\n"
    while len(text) > MAX_NOTE and len(lines) > 3:  # drop the least severe lines until it fits
        lines.pop()
        text = "\n".join(lines + ["- … (the rest in alerts.json)"]) + "\n"
    return text


def kinds_of(alerts: list[dict[str, Any]],
             counts: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``run_note``'s ``kinds`` from the emitted alerts (``Alert.to_dict()``s, in order) and, when
    given, the session summary's per-kind counts and severities (``summary()["alerts"]``)."""
    out: dict[str, dict[str, Any]] = {}
    for a in alerts:
        k = str(a.get("kind"))
        info = out.setdefault(k, {"count": 0, "severity": a.get("severity"), "first": a})
        info["count"] += 1
        if int(a.get("step", 0)) < int(info["first"].get("step", 0)):
            info["first"] = a
        if _RANK.get(str(a.get("severity")), 0) > _RANK.get(str(info["severity"]), 0):
            info["severity"] = a.get("severity")
    for k, s in (counts or {}).items():
        if k in out and isinstance(s, dict):
            out[k]["count"] = max(out[k]["count"], int(s.get("count") or 0))
            if s.get("severity") in _RANK:
                out[k]["severity"] = s["severity"]
    return out


def fill_note(runner: Any, tags: dict[str, str]) -> None:
    """Runner side, before the ``log_batch`` that carries a note: put the run's page into
    :data:`RUN_HREF`; on a run trackdiag did not create (the user's, Lightning's, the HF
    Trainer's), leave a note the user wrote alone (one ``get_run``, once)."""
    if NOTE_TAG not in tags:
        return
    state = runner.state
    if not state.get("owns_run"):
        if getattr(runner, "user_note", None) is None:
            current = runner.client.get_run(state["run_id"]).data.tags.get(NOTE_TAG)
            runner.calls += 1
            runner.user_note = bool(current) and not current.startswith(MARK)
        if runner.user_note:
            del tags[NOTE_TAG]
            return
    href = f"#/experiments/{state.get('experiment_id')}/runs/{state['run_id']}"
    tags[NOTE_TAG] = tags[NOTE_TAG].replace(RUN_HREF, href)


def run_url(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """The run's page in the UI's "Model training" view: on the server for http(s) stores, on
    ``mlflow ui``'s default address (``http://127.0.0.1:5000``) for local ones; None when the run
    was never made or the store has no UI of its own to point at (e.g. ``databricks``)."""
    if not run_id or not experiment_id:
        return None
    if tracking_uri.startswith(("http://", "https://")):
        base = tracking_uri.rstrip("/")
    elif tracking_uri.startswith(("sqlite:", "file:", "/", "postgresql", "mysql", "mssql")) \
            or "://" not in tracking_uri:
        base = f"http://127.0.0.1:{UI_PORT}"
    else:
        return None
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{VIEW}"


def closing_lines(tracking_uri: str, state: dict[str, Any], status: str, health: str) -> list[str]:
    """What the MLflow sink prints last: the run's page (:func:`run_url`) and, for a local store,
    the one command that serves it (this interpreter's ``-m mlflow ui``, so it works pasted into
    a shell without the venv). Credentials in the URI are masked."""
    from trackdiag.sinks.mlflow.store import ui_command
    from trackdiag.util.redact import DEFAULT_POLICY

    url = run_url(tracking_uri, state.get("experiment_id"), state.get("run_id"))
    if url is None:
        return []
    lines = [f"trackdiag: MLflow run {status}, health {health}: {DEFAULT_POLICY.text(url)}"]
    if not tracking_uri.startswith(("http://", "https://")):
        lines.append(f"  to open it, start the UI first: {DEFAULT_POLICY.text(ui_command(tracking_uri))}")
    return lines
