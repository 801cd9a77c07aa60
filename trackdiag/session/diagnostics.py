"""The diagnostics session: hooks, schedules, the one host copy per logging step, rules, sinks (its end:
:mod:`trackdiag.session.close`)."""
from __future__ import annotations

import atexit
import collections
import logging
import time
from typing import TYPE_CHECKING, Any, Mapping

import torch

from trackdiag.alerts.book import AlertBook, merge_places
from trackdiag.alerts.incidents import Incidents, order
from trackdiag.alerts.objectives import Objectives
from trackdiag.capture.components import batch_size_of, build_components
from trackdiag.capture.context import Component, ProbeContext, StepInputs
from trackdiag.capture.forward_watch import compiled_parts
from trackdiag.config.load import resolve, to_plain
from trackdiag.core import watchers
from trackdiag.core.alert import Alert
from trackdiag.core.errors import AlertRaised
from trackdiag.core.record import Record
from trackdiag.core.registry import PROBES, RULES, SINKS, lookup
from trackdiag.core.runinfo import RunInfo, resolve_run
from trackdiag.probes.base import Probe
from trackdiag.rules.base import Rule
from trackdiag.session.budget import CostBudget
from trackdiag.session.checks import SetupChecks
from trackdiag.session.close import RunEnd
from trackdiag.session.distributed import DistSync
from trackdiag.session.evaluations import Evaluations
from trackdiag.session.flight import FlightRecorder
from trackdiag.session.guards import Guards, enrich_alerts
from trackdiag.session.micro_steps import PREPARED
from trackdiag.session.step_plan import StepPlan
from trackdiag.session.steps import OptimizerEvents
from trackdiag.sinks.base import Sink, SinkHub
from trackdiag.util import exit_status
from trackdiag.util.ranks import is_main_process
from trackdiag.util.transfer import to_host
from trackdiag.util.uninterrupted import uninterrupted

if TYPE_CHECKING:
    from trackdiag.session.disabled import DisabledDiagnostics

log = logging.getLogger("trackdiag")


def _build(family: dict[str, str], name: str, entry: Mapping[str, Any] | None) -> Any:
    entry = dict(entry or {})
    return lookup(family, name, entry)(**{k: v for k, v in entry.items() if k != "_target_"})


class Diagnostics(OptimizerEvents, StepPlan, SetupChecks, FlightRecorder, RunEnd, Guards, CostBudget,
                  Evaluations):
    """Training diagnostics for one run. See the README for the metric keys and alert kinds.

    Args:
        model: an ``nn.Module`` or a dict of named modules (any string keys).
        optimizer: an optimizer (any wrapper: accelerate, Lightning, ZeRO, ...; a list for several),
            a dict of them paired with the models by key, or ``None``: an optimizer that later steps
            these parameters is adopted at its first step (or pass it to :meth:`attach`).
        scaler: the AMP ``GradScaler``, if any.
        level: preset name (``basic`` | ``advanced`` | ``extreme``).
        sinks: sink names (default: the preset's). hparams: the user's config, logged with the run.
        loss_fn: your loss computation, ``loss_fn(batch) -> loss`` (or an object with ``.loss``, or a
            ``(loss, outputs)`` tuple), used by every probe that re-evaluates the loss (landscape,
            pre-flight, NaN replay); also settable later as ``diag.loss_fn``. See docs/crash-and-replay.md.
        **overrides: any preset key (``every=5``, ``rules={"grad_explosion": {"threshold": 50}}``).
    Raises:
        ConfigError: listing every problem of the merged config, before anything is hooked.
    """

    enabled = True

    def __init__(self, model: Any, optimizer: Any = None, scaler: Any = None, *, level: str = "advanced",
                 sinks: list[str] | None = None, hparams: Any = None, loss_fn: Any = None, **overrides: Any) -> None:
        cfg: dict[str, Any] = {"level": level, **overrides}
        if sinks is not None:
            cfg["sinks"] = list(sinks)
        self._setup(resolve(cfg), model, optimizer, scaler, hparams)
        self.loss_fn = loss_fn

    @classmethod
    def from_config(cls, cfg: Any, *, model: Any, optimizer: Any = None, scaler: Any = None,
                    hparams: Any = None, loss_fn: Any = None) -> "Diagnostics | DisabledDiagnostics":
        """A session from a Hydra ``diag`` node; a no-op session when ``cfg`` is None or disabled."""
        from trackdiag.session.disabled import DisabledDiagnostics

        plain = to_plain(cfg)
        if plain is None or (isinstance(plain, Mapping) and plain.get("enabled", True) is False):
            return DisabledDiagnostics()
        self = cls.__new__(cls)
        self._setup(resolve(plain), model, optimizer, scaler, hparams)
        self.loss_fn = loss_fn
        return self

    # ------------------------------------------------------------------ set-up
    def _setup(self, cfg: dict[str, Any], model: Any, optimizer: Any, scaler: Any, hparams: Any) -> None:
        self.config = cfg
        self.every: int = cfg["every"]
        self.components: list[Component] = build_components(model, optimizer, cfg["max_layer_metrics"])
        self._ctx = ProbeContext(self.components, self.every, cfg["max_layer_metrics"], scaler)
        self._ctx.compiled = any(compiled_parts(m) for m in (model.values() if isinstance(model, Mapping) else [model]))
        self.probes: list[Probe] = [_build(PROBES, n, e) for n, e in cfg["probes"].items() if (e or {}).get("enabled", True)]
        self.rules: list[Rule] = [_build(RULES, n, e) for n, e in cfg["rules"].items() if (e or {}).get("enabled", True)]
        self.objectives = Objectives(cfg.get("objective", "auto"))
        for r in self.rules:
            r.objectives = self.objectives
        self._dist = DistSync.detect(self.components)  # None outside torch.distributed
        main = is_main_process()  # only rank 0 opens tracker runs and writes the local record/artifacts
        # the local record and the console summary join every session (sinks=["local"] and diag/sink=local alike);
        # diag.sink.console.enabled=false silences the console
        quiet = (cfg["sink"].get("console") or {}).get("enabled", True) is False
        names = [n for n in dict.fromkeys(["local", "console", *cfg["sinks"]]) if not (quiet and n == "console")]
        sinks: list[Sink] = [_build(SINKS, n, cfg["sink"].get(n)) for n in names] if main else []
        for p in self.probes:
            p.bind(self.every)
            p.attach(self._ctx)
        self._on_step = [p for p in self.probes if type(p).on_step is not Probe.on_step]
        self._init_plan()
        self._after_record = [p for p in self.probes if type(p).after_record is not Probe.after_record]
        self._eval_probes = [p for p in self.probes if hasattr(p, "on_eval")]
        self._schedules = self._distinct_schedules()
        self._init_budget(cfg)
        name, out_dir, cwd, group, job = resolve_run(cfg["output_dir"], cfg["run_name"])
        self.run = RunInfo(name, out_dir, cfg["level"], cfg, to_plain(hparams) or {}, cwd, group, job,
                           components=[c.name for c in self.components])
        self._ctx.output_dir = out_dir if main else None
        self._hub = SinkHub(sinks)
        self._book = AlertBook()
        self._incidents = Incidents()
        self._history: collections.deque[Record] = collections.deque(maxlen=cfg["history"])
        self._disabled: dict[str, str] = {}
        self._handles: list[Any] = []
        self._step = 0
        self._last_logged = -1
        self._logging: int | None = None  # the step whose window is being logged (see close())
        self._unsent: Record | dict[int, dict[str, Any]] | None = None  # collected (per probe) or measured, not yet sent
        self._overhead = 0.0
        self._window_overhead = 0.0
        self._t_first: float | None = None
        self._t_last = 0.0
        self._opened = self._closed = False
        self.should_stop = False
        self._preflighted = False
        self._held_fit: Any = None  # a pre-flight fit judged at the next step (SetupChecks._settle_fit)
        self._plainly = False  # the next steps may take the plain path (_lane_open)
        self._warned_shape: set[str] = set()
        self._struck: dict[str, tuple[str, Exception]] = {}  # probes whose last collect/publish failed (see _guard)
        self._init_events()

    # ------------------------------------------------------------------ public API
    @property
    def alerts(self) -> list[Alert]:
        """Every alert emitted so far (after cooldown), in order."""
        return list(self._book.alerts)

    @property
    def global_step(self) -> int:
        """Number of optimizer steps seen (the step the next ``step()`` call records)."""
        return self._step

    def __enter__(self) -> "Diagnostics":
        self._open()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._note_exit(exc)  # for the crash finding (flight.py)
        try:
            self.close(exit_status.status_of(exc))  # KeyboardInterrupt: KILLED, other exceptions: FAILED
        except KeyboardInterrupt:
            if not isinstance(exc, KeyboardInterrupt):
                raise
            # a second Ctrl-C cut the close short (see close()): the first one goes on up, one traceback

    def _open(self) -> None:
        if not self._opened:
            self._opened = True
            exit_status.install()  # uncaught exceptions and SIGTERM decide the status of a close at exit
            exit_status.track(self)
            self._hub.open(self.run)
            atexit.register(self.close)
            watchers.opened(self)  # e.g. an Optuna trial's stopper (integrations/optuna.py)

    def step(self, loss: Any = None, *, outputs: Any = None, batch: Any = None, batch_size: int | None = None) -> bool:
        """Record one optimizer step. Call once per optimizer step, after it.

        ``loss``/``outputs`` may be dicts keyed by component name. On non-logging steps this costs
        a device copy of the loss and a few Python calls; on logging steps, one host copy of every
        diagnostic. Returns ``should_stop``. Raises ``AlertRaised`` for a rule whose action is ``raise``.
        """
        t0 = time.perf_counter()
        ctx = self._ctx
        # the plain step (most steps): a scalar loss, no micro-batches, no pre-flight pending, not a logging step nor a
        # window check (the step plan, step_plan.py): the same work as below with nothing asked that cannot apply
        # accelerate's gradient state, or a model it prepared (flagged perhaps after the session began): only then can
        # the step be a micro-step (C-level tests: _is_micro_step's frames are not paid without accelerate)
        accelerated = self._grad_states or self._typed_accelerate or any(map(PREPARED, self._model_dicts))
        if type(loss) is torch.Tensor and self._plainly and ctx.step < self._next_check and ctx.step > ctx.anomaly_until \
                and loss.ndim == 0 and not self._phase_pending and not (accelerated and self._is_micro_step()):
            return self._plain(t0, ctx, loss, outputs, batch, batch_size)
        if not self._opened:
            self._open()
        if self._t_first is None:
            self._t_first = t0
        elif self._gaps is not None:  # the cost budget's measure of the loop (session_budget.py)
            self._gaps.append(t0 - self._t_last)
        if type(loss) is dict or (not isinstance(loss, torch.Tensor) and isinstance(loss, Mapping)):
            losses = {k: self._scalar_loss(k, v) for k, v in loss.items()}
        else:
            losses = {"": self._scalar_loss("", loss)}
        if self._is_micro_step():  # accelerate's accumulate: not an optimizer step yet
            self._micro.append(losses)
            self._plainly = False  # the step that merges them takes the full path
            self._window_overhead += time.perf_counter() - t0
            return self.should_stop
        losses = self._merge_micro(losses)
        self.objectives.observe(losses)
        inputs = StepInputs(losses, outputs, batch, batch_size if batch_size is not None else batch_size_of(batch))
        if not self._preflighted:
            self._auto_preflight(inputs)
        elif self._held_fit is not None:
            self._settle_fit()
        self._finish_components()
        for p in self._busy_probes():  # only probes that implement on_step and have work until the next logging step
            if p.enabled:
                try:
                    p.on_step(ctx, inputs)
                except Exception as exc:
                    self._fail(p, "on_step", exc)
        if self._phase_pending:
            self._phase_pending = False
            ctx.phase, ctx.phase_start = ctx.phase + 1, ctx.step
        self._phase_ready = True
        raised = None
        log_now = False
        if not self._plain_step(ctx.step):  # the step plan (step_plan.py): most steps ask no schedule
            for sched in self._schedules:  # a few distinct schedules, not every probe
                if ctx.is_due(sched):
                    log_now = True
                    break
            else:  # under a stretched cadence (budget.py): a logging step at a NaN/Inf or a jump in the window too
                log_now = bool(self._checks) and self._window_check(ctx.step)
            self._plan_after(ctx.step)
        if log_now:
            self._logging = ctx.step  # a Ctrl-C in here: close() logs this step's window again
            ctx.losses = losses  # for the logging step only: no graph is held past it
            try:
                raised = self._log(ctx.step)
            finally:
                ctx.losses = None
            self._logging = None
            self._check_reindex()
            self._replan()
        self._reset_steps()
        self._step += 1
        ctx.step = self._step
        self._plainly = self._lane_open()
        self._t_last = time.perf_counter()
        self._window_overhead += self._t_last - t0
        if log_now:
            self._log_seconds = self._t_last - t0  # the next window's logging part (the cost budget's)
        if raised is not None:
            raise AlertRaised(raised)
        return self.should_stop

    def _scalar_loss(self, name: str, value: Any) -> Any:
        """A loss of more than one element (per-sample losses) is reduced to its mean, with a
        one-time warning (device op, no sync)."""
        if type(value) is torch.Tensor and value.ndim == 0:  # the usual scalar loss
            return value
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            if name not in self._warned_shape:
                self._warned_shape.add(name)
                log.warning("trackdiag: the loss%s passed to step() has shape %s; recording its mean. Pass the "
                            "scalar loss you call backward() on.", f" {name!r}" if name else "", tuple(value.shape))
            return value.detach().float().mean() if value.numel() else None
        return value

    def _log(self, step: int, final: bool = False, resume: dict[int, dict[str, Any]] | None = None) -> Alert | None:
        """Collect, measure, judge and send the record of ``step``'s window. ``resume``: what a logging step cut
        short by a Ctrl-C had collected, per probe (close() finishes it: a ``collect`` forgets what it hands over,
        so the collection holds a Ctrl-C until every probe's values are stored, and a probe collects once)."""
        ctx = self._ctx
        collected: dict[int, dict[str, Any]] = {} if resume is None else resume
        self._unsent = collected  # a Ctrl-C from here on: close() finishes this record
        with uninterrupted():  # a collect cut short would drop what it had taken
            for i, p in enumerate(self.probes):
                if i not in collected and p.enabled and (
                        p.always_collect or ((not final or resume is not None) and ctx.is_due(p.schedule))):
                    collected[i] = self._guard(p, "collect", ctx) or {}
        record = self._measured(step, collected)
        n = max(step - self._last_logged, 1)
        hooks, ctx.hook_seconds = ctx.hook_seconds, 0.0
        self._window_overhead += hooks  # forward/backward hooks ran inside the user's passes
        record.scalars["diag/perf/overhead_ms"] = 1e3 * self._window_overhead / n
        if not final:
            self._budget_window(step, self._window_overhead, hooks)
        self._overhead += self._window_overhead
        self._window_overhead = 0.0
        alerts = self._judge("check", record, self._history, self.components)
        if final:
            alerts += self._judge("at_close", record, self._history, self.components)
        ctx.anomaly_until = max([ctx.anomaly_until, *(r.follow_until for r in self.rules if r.enabled)])
        alerts = enrich_alerts(self.probes, ctx, alerts)  # NaN replay: the culprit module into `where`
        for p in self._after_record:
            if p.enabled:
                self._guard(p, "after_record", ctx, record)
        self._history.append(record)
        with uninterrupted():  # sent once, and known to be sent (a Ctrl-C between: lost, or sent twice by close())
            raised = self._emit(record, alerts)
            self._last_logged = step
        return raised

    def _measured(self, step: int, collected: dict[int, dict[str, Any]]) -> Record:
        """The record of what the probes collected (probe index -> values): one host copy, then each probe publishes."""
        ctx = self._ctx
        host = to_host({f"{i}\t{k}": v for i, vals in collected.items() for k, v in vals.items()})
        if self._dist is not None:  # collective: every rank reduces, then judges the same record
            host, reduced = self._dist.reduce(host, self.probes)
        record = Record(step=step, time=time.time())
        if ctx.phase and ctx.phase_start > self._last_logged:  # a training phase began in this window
            record.tables["diag/phase"] = {"start": float(ctx.phase_start), "phase": float(ctx.phase)}
            record.scalars["diag/phase"] = float(ctx.phase)
        by_probe: dict[int, dict[str, Any]] = collections.defaultdict(dict)
        for k, v in host.items():
            i, _, key = k.partition("\t")
            by_probe[int(i)][key] = v
        with uninterrupted():  # a Ctrl-C mid-publish would leave the record without a probe's values
            for i, mine in sorted(by_probe.items()):
                self._guard(self.probes[i], "publish", ctx, mine, record)
            if self._dist is not None:
                reduced.apply(record)
            self._unsent = record  # measured: a Ctrl-C from here on sends it as it is (before: measured again)
        return record

    def _emit(self, record: Record, alerts: list[tuple[Rule, Alert]]) -> Alert | None:
        """Fold findings into incidents (:mod:`trackdiag.alerts.book`), apply actions, send the record
        and its new alerts to the sinks. Returns the first alert whose action is ``raise``."""
        raised = None
        for rule, alert in sorted(merge_places(alerts, self.config.get("max_alerts_per_rule", 3)), key=lambda ra: order(ra[1])):
            root = self._book.absorbing(alert)
            if not self._incidents.screen(alert) or root is not None:
                self._book.suppress(alert, root)  # a consequence of an open incident
                continue
            if not self._book.admit(alert, rule.cooldown, rule.incident_key(alert)):
                continue
            record.alerts.append(alert)
            loud = alert.severity != "info"
            if rule.action == "log" or not loud:
                log.info("trackdiag: %s", alert.describe())
            else:
                log.warning("trackdiag: %s", alert.describe())
            if rule.action == "stop" and loud:
                self.should_stop = True
            elif rule.action == "raise" and loud and raised is None:
                raised = alert
        self._incidents.update(record)
        if any(a.severity != "info" for a in record.alerts) and self.config["anomaly_window"]:
            self._ctx.anomaly_until = max(self._ctx.anomaly_until, self._step + self.config["anomaly_window"])
        if record is self._unsent:
            self._unsent = None
        self._hub.write(record)
        for alert in record.alerts:
            self._hub.alert(alert)
        return raised

    def state_dict(self) -> dict[str, Any]:
        """Step counter and probe/rule state, to save with a checkpoint."""
        return {"step": self._step, "probes": {p.name: p.state_dict() for p in self.probes},
                "rules": {r.kind: r.state_dict() for r in self.rules}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict``: EMAs, streaks and the step counter carry over."""
        self._step = self._ctx.step = int(state["step"])
        self._last_logged = self._step - 1
        for p in self.probes:
            p.load_state_dict(state["probes"].get(p.name, {}))
        for r in self.rules:
            r.load_state_dict(state["rules"].get(r.kind, {}))
