"""One contender of the overhead benchmark: its own model, optimizer, batch stream and session.

Every arm is built from the same seed (same initial weights, same batches). A *turn* runs a few
steps of one arm and times them: wall time (``perf_counter``; on CUDA with ``torch.cuda.synchronize``
before and after, so a turn holds exactly its own kernels) and process CPU time. Under ``--compile``
each arm's model is wrapped by ``torch.compile`` and Dynamo's counters are read around every turn,
so graph breaks, graphs and frames compiled are charged to the arm whose steps caused them. An arm
that raises is marked failed (with the error) and sits out the rest; the others go on.
"""
from __future__ import annotations

import contextlib
import logging
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

import trackdiag
from isolation import alone
from workloads import Workload

PRESETS = ("basic", "advanced", "extreme")
_current: list["Arm"] = []  # the arm whose turn is running (for the recompile-limit log handler)


def dynamo_counts() -> tuple[int, int, int]:
    """(graph breaks, unique graphs, frames compiled) so far in this process, from Dynamo's counters."""
    from torch._dynamo.utils import counters

    return (sum(counters["graph_break"].values()), int(counters["stats"]["unique_graphs"]), int(counters["frames"]["total"]))


class _LimitHits(logging.Handler):
    """Charges Dynamo's 'hit config.recompile_limit' warnings to the arm whose turn is running."""

    def emit(self, record: logging.LogRecord) -> None:
        if _current and "recompile_limit" in record.getMessage():
            _current[-1].dyn[3] += 1


def watch_recompile_limit() -> None:
    logger = logging.getLogger("torch._dynamo")
    if not any(isinstance(h, _LimitHits) for h in logger.handlers):
        logger.addHandler(_LimitHits(logging.WARNING))


#: the ``torch.compile`` backend of ``--compile`` (overhead.py ``--backend``): Inductor, as users compile; the tests
#: check the table's plumbing with ``aot_eager`` (Dynamo and AOTAutograd, the same graphs, breaks and recompiles, without
#: Inductor's C++ builds: ~35 CPU-s on a fresh 2-core machine)
BACKEND = "inductor"


class Arm:
    """One contender: ``bare``, ``disabled``, a preset, or a peer (``wandb.watch``, ``cockpit``)."""

    def __init__(self, name: str, wl: Workload, tmp: Path, device: torch.device, compiled: bool = False,
                 amp: torch.dtype | None = None, seed: int = 0) -> None:
        self.name, self.wl, self.device, self.compiled, self.amp = name, wl, device, compiled, amp
        self.error: str | None = None
        self.notes: list[str] = []
        self.walls: list[float] = []
        self.cpu: list[float] = []
        self.diag: Any = None
        self.cockpit: Any = None
        self.attributed = float("nan")  # own ms/step over the measured rounds (preset arms)
        self.dyn = [0, 0, 0, 0]      # Dynamo: graph breaks, unique graphs, frames compiled, recompile-limit hits
        self.alone: list[int] = []   # the same, for this arm run alone from a reset (compile accounting)
        self.global_step = 0
        self._spent0, self._steps, self._wall, self._cpu = 0.0, 0, 0.0, 0.0
        torch.manual_seed(seed)
        self.model = wl.make_model().to(device)
        # several models (wl.parts): one optimizer each, handed to the session as dicts, as a user would
        self.parts = wl.parts(self.model) if wl.parts is not None else None
        self.opts = {k: torch.optim.AdamW(m.parameters(), lr=wl.lr) for k, m in (self.parts or {"": self.model}).items()}
        self.opt = next(iter(self.opts.values()))
        self.scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
        self.net = torch.compile(self.model, backend=BACKEND) if compiled else self.model
        watched = self.parts if self.parts is not None else self.net
        given = self.opts if self.parts is not None else self.opt
        self.gen = torch.Generator(device=device).manual_seed(seed + 1)
        self.loss_fn: Callable[[Any, Any], Any] = wl.loss
        self.backward: Callable[[Any, Any, Any], Any] = self._backward
        self.after: Callable[[Any, Any, Any], Any] = lambda loss, out, batch: None
        self.closer: Callable[[], Any] = lambda: None
        if name == "disabled":
            diag = trackdiag.Diagnostics.from_config(None, model=watched, optimizer=given, scaler=self.scaler)
            self.after = self._stepper(diag)
        elif name.partition("+")[0] in PRESETS:  # a preset, or a preset+variant (see VARIANTS)
            level, _, variant = name.partition("+")
            diag = trackdiag.Diagnostics(watched, given, self.scaler, level=level, sinks=["local"],
                                         output_dir=str(tmp / f"{wl.name}-{name}"), **_excluded(variant))
            diag.__enter__()
            self.after = self._stepper(diag)
            self.closer = diag.close
            self.diag = diag
        elif name == "wandb.watch":
            import wandb

            run = wandb.init(mode="offline", dir=str(tmp), project="bench")  # watch() logs through the global run
            run.watch(self.model, log="all", log_freq=10)
            self.closer = run.finish
        elif name == "cockpit":
            from cockpit_arm import attach

            attach(self)
        elif name != "bare":
            raise ValueError(f"unknown arm {name!r}")

    def _stepper(self, diag: Any) -> Callable[[Any, Any, Any], Any]:
        """The arm's ``diag.step`` call: with outputs and the batch ``(x, y)`` as the README's loop hands them over, or
        the loss alone (``wl.step_batch``)."""
        if self.wl.step_batch:
            return lambda loss, out, batch: diag.step(loss, outputs=out, batch=batch)
        return lambda loss, out, batch: diag.step(loss)

    def _backward(self, loss: torch.Tensor, out: Any, y: Any) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.amp)

    def step(self) -> None:
        """One training step: the loop of nanoGPT's train.py (scaler optional) plus the arm's hook."""
        x, y = batch = self.wl.make_batch(self.gen)
        with self._autocast():
            if self.wl.run is not None:  # the workload's own forward (a Python loop of calls) and loss
                loss, out = self.wl.run(self.net, batch)
            else:
                out = self.net(x)
                loss = self.loss_fn(out, y)
        self.backward(loss, out, y)
        if self.wl.clip is not None:  # nanoGPT: unscale, then clip every parameter's gradient
            for opt in self.opts.values():
                if self.scaler is not None:
                    self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.wl.clip)
        for opt in self.opts.values():
            if self.scaler is not None:
                self.scaler.step(opt)
            else:
                opt.step()
        if self.scaler is not None:
            self.scaler.update()
        for opt in self.opts.values():
            opt.zero_grad(set_to_none=True)
        self.after(loss, out, batch)  # batch=(x, y), as the README's loop hands it over
        self.global_step += 1

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def turn(self, steps: int, timed: bool = True) -> None:
        """``steps`` steps of this arm, timed as one piece; an exception marks the arm failed."""
        if self.error:
            return
        _current.append(self)
        d0 = dynamo_counts() if self.compiled else (0, 0, 0)
        try:
            with alone(self.diag, self.model):  # only this arm's session hears the process-wide hooks
                self._sync()
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(steps):
                    self.step()
                self._sync()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        except Exception as exc:  # noqa: BLE001 - reported in the table, the other arms go on
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            self.notes.append(traceback.format_exc(limit=-3))
            return
        finally:
            _current.pop()
            if self.compiled:
                for i, (a, b) in enumerate(zip(d0, dynamo_counts())):
                    self.dyn[i] += b - a
        if timed:
            self._wall += wall
            self._cpu += cpu
            self._steps += steps

    def account(self, steps: int) -> None:
        """Compile accounting: ``steps`` untimed steps of this arm alone, from a fresh Dynamo state at
        the default recompile limit (8), as in a user's process; the counts go to ``alone``."""
        from torch._dynamo import config, reset

        reset()
        limit, config.recompile_limit = config.recompile_limit, 8
        try:
            self.dyn = [0, 0, 0, 0]
            self.turn(steps, timed=False)
            self.alone, self.dyn = self.dyn, [0, 0, 0, 0]
        finally:
            config.recompile_limit = limit

    def end_round(self, steps: int) -> None:
        if self.error:
            return
        self.walls.append(self._wall / steps)
        self.cpu.append(self._cpu / steps)
        self._wall = self._cpu = 0.0

    def spent(self) -> float:
        """trackdiag's own seconds so far: training-thread time (hooks included) + sink-thread CPU."""
        if self.diag is None:
            return 0.0
        o = self.diag.summary()["overhead"]
        return o["seconds"] + o["sink_thread_cpu_seconds"]

    def start_measuring(self) -> None:
        self.walls.clear()
        self.cpu.clear()
        self._spent0, self._steps, self._wall, self._cpu = self.spent(), 0, 0.0, 0.0
        self.dyn = [0, 0, 0, 0]  # from here on: what compiles while timed

    def attributed_ms(self) -> float:
        """trackdiag's own milliseconds per measured step (nan for arms without a session)."""
        return 1e3 * (self.spent() - self._spent0) / self._steps if self.diag is not None and self._steps else float("nan")

    def finish(self) -> None:
        """Attributed time (before close: end-of-run artifacts excluded), close, collect notes."""
        if self.error is None:
            self.attributed = self.attributed_ms()
        try:
            self.closer()
        except Exception as exc:  # noqa: BLE001
            self.notes.append(f"close failed: {type(exc).__name__}: {exc}")
        if self.diag is not None:
            off = self.diag.summary().get("disabled_probes") or {}
            if off:
                self.notes.append("probes switched off: " + "; ".join(f"{k} ({str(v)[:120]})" for k, v in off.items()))
        if self.cockpit is not None and self.error is None:
            from cockpit_arm import logged_quantities

            self.cockpit_quantities = logged_quantities(self)
            if not self.cockpit_quantities:
                self.error = "Cockpit logged no quantity"


#: ``<preset>+<variant>`` arms: the preset with one feature switched (the flight recorder's cost)
VARIANTS: dict[str, dict[str, Any]] = {
    "modules": {"flight": {"modules": True}},     # per-module output flags in every training forward
    "nomodules": {"flight": {"modules": False}},
    "noflight": {"flight": {"enabled": False}},   # no flight recorder at all
    "logreplay": {"nan_replay": {"mode": "log"}},  # NaN replay at the logging step (no per-step sync)
    "lean": {"flight": {"modules": False}, "nan_replay": {"mode": "log"}},
    "noreplay": {"nan_replay": {"enabled": False}},
    "layers50": {"grads": {"every": 50}, "gradflow": {"every": 50}, "outputs": {"every": 50}},
    "asadv": {"flight": {"modules": False}, "nan_replay": {"mode": "log"}, "params": {"every": 50}, "updates": {"every": 50},
              "activations": {"every": 50}, "memory_phases": {"every": 50}, "histograms": {"every": 500}},
}
#: variants that set a top-level key: the logging cadence (``advanced+every50``), no cost budget (``advanced+nobudget``)
TOP_VARIANTS: dict[str, dict[str, Any]] = {"every20": {"every": 20}, "every50": {"every": 50}, "nobudget": {"budget": None}}


def _excluded(variant: str = "") -> dict[str, Any]:
    """Expensive scheduled artifacts (landscapes) are timed separately, not in the preset arms; a
    ``variant`` (:data:`VARIANTS`, :data:`TOP_VARIANTS`) switches one feature; several join with ``+``
    (``noreplay+nobudget``)."""
    from trackdiag.core.registry import PROBES

    probes: dict[str, Any] = {"landscape": {"enabled": False}} if "landscape" in PROBES else {}
    top: dict[str, Any] = {}
    for one in filter(None, variant.split("+")):
        if one in TOP_VARIANTS:
            top.update(TOP_VARIANTS[one])
        elif one in VARIANTS:
            probes.update(VARIANTS[one])
        else:
            raise ValueError(f"unknown arm variant {one!r}; accepted: {', '.join([*VARIANTS, *TOP_VARIANTS])}")
    return {"probes": probes, **top} if probes or top else {}
