"""Where a crash of autograd's in-place check comes from ("one of the variables needed for gradient computation has
been modified by an inplace operation").

The traceback of that error ends in ``loss.backward()``: it says which tensor (``output 0 of SigmoidBackward0``) but
not where the model made it. At the crash, the step's captured forward calls (the NaN replay's, ``advanced`` and
``extreme``) are replayed once on the current weights (the optimizer has not stepped: the error comes before it) under
``torch.autograd.detect_anomaly(check_nan=False)``, and the gradients are taken with ``torch.autograd.grad`` of the
outputs' sum (nothing is accumulated into ``.grad``; BatchNorm's running statistics are restored: ``isolated``). The
error comes again, and anomaly mode's warning holds the traceback of the forward call that made the tensor: its
innermost line in the user's code, and the module whose ``forward`` holds that line, are what the crash finding names.
Host work on the crash path only.
"""
from __future__ import annotations

import logging
import re
import warnings
from typing import Any

import torch
from torch import nn

from trackdiag.capture.forward_watch import FORWARD
from trackdiag.capture.gradtap import TAP_QUEUE
from trackdiag.capture.isolation import eager, isolated, replaying
from trackdiag.core.errors import brief
from trackdiag.util.tensors import float_tensors

log = logging.getLogger("trackdiag")

#: the text of autograd's in-place check
INPLACE = "modified by an inplace operation"
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\s*$')
_LIBRARY = ("site-packages/", "/torch/", "/trackdiag/")


def is_inplace_error(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and INPLACE in str(exc)


def forward_frames(text: str) -> list[tuple[str, int, str, str]]:
    """``(path, line, function, code)`` of each frame in an anomaly-mode traceback, outermost first."""
    out: list[tuple[str, int, str, str]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            out.append((m["path"], int(m["line"]), m["func"], code))
    return out


def module_at(model: nn.Module, path: str, line: int) -> str | None:
    """The name of the first module of ``model`` whose class's ``forward`` holds ``path:line`` (``""``: the root)."""
    for name, mod in model.named_modules():
        code = getattr(type(mod).forward, "__code__", None)
        if code is not None and code.co_filename == path and line in {ln for *_, ln in code.co_lines() if ln is not None}:
            return name
    return None


def origin(model: nn.Module, call: tuple[Any, ...]) -> tuple[str, int, str, str, str | None] | None:
    """Replay one captured forward ``call`` of ``model`` and its gradients under anomaly detection; when autograd's
    in-place check fails again, ``(file, line, function, code, module)`` of the forward line that made the tensor
    (the innermost frame outside torch, libraries and trackdiag), else None."""
    args, kwargs = call[:2]
    target = call[3] if len(call) > 3 else model
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    run = replaying(args, kwargs)
    with warnings.catch_warnings(record=True) as caught, TAP_QUEUE.pause(), eager(), FORWARD.paused(), \
            isolated(model), torch.enable_grad():
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly(check_nan=False):
            outputs = run(target)
            parts = [t.float().sum() for _, t in float_tensors(outputs, "") if t.requires_grad]
            if not parts:
                return None
            try:
                torch.autograd.grad(torch.stack(parts).sum(), params, allow_unused=True)
            except RuntimeError as exc:
                if INPLACE not in str(exc):
                    return None
            else:
                return None  # the replay did not fail: the modification depends on state the replay does not hold
    for w in caught:
        text = str(w.message)
        if "Traceback of forward call" not in text:
            continue
        mine = [f for f in forward_frames(text) if not any(lib in f[0].replace("\\", "/") for lib in _LIBRARY)]
        if mine:
            path, line, func, code = mine[-1]
            return path, line, func, code, module_at(model, path, line)
    return None


def origin_at_crash(nan: Any, ctx: Any) -> tuple[str, tuple[str, int, str, str, str | None]] | None:
    """At a crash of autograd's in-place check: ``(component, origin)`` of the forward line that made the tensor, from
    the NaN replay probe ``nan``'s captured calls of the running step (each component's first), or None."""
    for comp in ctx.components:
        calls = nan.calls_of(ctx.step, comp.name) if comp.model is not None else []
        try:
            with nan.capture_paused():
                found = origin(comp.model, calls[0]) if calls else None
        except Exception as exc:  # noqa: BLE001 - the crash finding is made without it
            log.debug("trackdiag: in-place replay failed: %s", brief(exc))
            found = None
        if found is not None:
            return comp.name, found
    return None
