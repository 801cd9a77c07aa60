"""How the session keeps a failing probe or rule from touching training, mixed into
:class:`trackdiag.Diagnostics`: a probe or rule that raises is switched off with one warning (the reason
in ``summary()["disabled_probes"]``); a probe's ``collect``/``publish`` first gets a second chance.
Runs on logging steps and at close only. :func:`enrich_alerts` lets the NaN replay name its culprit in
the logging step's alerts, guarded the same way."""
from __future__ import annotations

import logging
from itertools import repeat
from typing import Any

from trackdiag.capture.context import ProbeContext
from trackdiag.core.alert import Alert
from trackdiag.core.errors import brief
from trackdiag.probes._replay_report import TRIGGERS
from trackdiag.probes.base import Probe
from trackdiag.probes.nan_replay import NanReplayProbe
from trackdiag.rules.base import Rule

log = logging.getLogger("trackdiag")


class Guards:
    """``_guard``, ``_settle``, ``_judge``, ``_fail``, ``_distinct_schedules``; see the module docstring."""

    def _guard(self, probe: Probe, method: str, *args: Any) -> Any:
        """Call a probe; a probe that fails is disabled with one warning, never kills training.
        ``collect``/``publish`` get a second chance: a window whose state a KeyboardInterrupt tore
        (a notebook cell interrupted mid-step and run again: a list appended to, its twin not) fails
        once and is dropped; a probe that fails again before publishing once more, or whose failure
        is still the last word at close, is disabled (``_settle``)."""
        try:
            out = getattr(probe, method)(*args)
        except Exception as exc:
            if method in ("collect", "publish") and probe.name not in self._struck:
                self._struck[probe.name] = (method, exc)
                log.debug("trackdiag: probe %r dropped its window at step %d (%s in %s)", probe.name,
                          self._ctx.step, brief(exc), method)
                return None
            self._struck.pop(probe.name, None)
            self._fail(probe, method, exc)
            return None
        if method == "publish" and self._struck:
            self._struck.pop(probe.name, None)
        return out

    def _settle(self) -> None:
        """At close: a probe whose window failed and that never published since is disabled (and said so)."""
        struck, self._struck = self._struck, {}
        for p in self.probes:
            if p.name in struck and p.enabled:
                self._fail(p, *struck[p.name])

    def _judge(self, method: str, *args: Any) -> list[tuple[Rule, Alert]]:
        """Every enabled rule's alerts for a record; a rule that raises is switched off with one
        warning (a diagnostics bug never stops training)."""
        out: list[tuple[Rule, Alert]] = []
        for r in self.rules:
            if not r.enabled:
                continue
            try:
                found = getattr(r, method)(*args)
            except Exception as exc:  # noqa: BLE001
                r.enabled = False
                self._disabled[f"rule:{r.kind}"] = f"{type(exc).__name__} in {method}: {exc}"
                log.warning("trackdiag: rule %r disabled: %s", r.kind, self._disabled[f"rule:{r.kind}"])
                continue
            if found:  # most rules find nothing: no list built for them (a logging step asks every rule)
                out.extend(zip(repeat(r), found))
        return out

    def _fail(self, probe: Probe, method: str, exc: Exception) -> None:
        probe.enabled = False
        self._schedules = self._distinct_schedules()
        self._disabled[probe.name] = f"{type(exc).__name__} in {method}: {exc}"  # full text: summary, record
        log.warning("trackdiag: probe %r disabled (%s in %s; full text in summary()['disabled_probes'])",
                    probe.name, brief(exc), method)

    def _distinct_schedules(self) -> list[Any]:
        """The enabled probes' schedules, each once: a step is a logging step if any fires."""
        return list(dict.fromkeys(p.schedule for p in self.probes if p.enabled))


def enrich_alerts(probes: list[Probe], ctx: ProbeContext, alerts: list[tuple[Any, Alert]]) -> list[tuple[Any, Alert]]:
    """Let an enabled ``nan_replay`` probe add its findings to ``alerts``; never raises."""
    for p in probes:
        if p.enabled and isinstance(p, NanReplayProbe) and any(a.kind in TRIGGERS for _, a in alerts):
            try:
                return p.enrich(ctx, alerts)
            except Exception as exc:  # noqa: BLE001
                log.warning("trackdiag: NaN replay failed: %s", brief(exc))
    return alerts
