"""The text of a ``crash`` finding: the exception, where in the model it was raised, the last steps of
the every-step series, and the remedies that fit.

Host work only, at the end of a run that died (nothing here runs per step): a walk of the
exception's traceback (or of the frame SIGTERM interrupted) for the innermost ``forward`` of one of
the session's modules, and a read of the records already in memory.
"""
from __future__ import annotations

import math
import os
import re
from types import FrameType, TracebackType
from typing import Iterable

from torch import nn

from trackdiag.capture.context import component_of
from trackdiag.core.record import Record

SERIES = (("loss", "loss"), ("grad/global_norm", "grad norm"))  # every-step series a crash finding shows


def tb_frames(tb: TracebackType | None) -> list[FrameType]:
    """The frames of a traceback, outermost first."""
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def stack_frames(frame: FrameType | None, limit: int = 200) -> list[FrameType]:
    """``frame`` and its callers, outermost first."""
    out = []
    while frame is not None and len(out) < limit:
        out.append(frame)
        frame = frame.f_back
    return out[::-1]


def module_in(frames: list[FrameType], names: dict[int, tuple[str, str]]) -> tuple[str, str, nn.Module] | None:
    """``(component, module name, module)`` of the innermost frame running the ``forward`` of one of
    the session's modules (``names``: id(module) -> (component, name)), or None."""
    for frame in reversed(frames):
        if frame.f_code.co_name not in ("forward", "_call_impl", "__call__"):
            continue
        obj = frame.f_locals.get("self")
        key = names.get(id(obj)) if isinstance(obj, nn.Module) else None
        if key is not None:
            return key[0], key[1], obj  # type: ignore[return-value]
    return None


def tb_lines(tb: TracebackType | None) -> list[int]:
    """The line each frame of a traceback was at when the exception passed through it (``tb_lineno``), outermost
    first. A frame's own ``f_lineno`` is where it is *now*: for the training script's frame, closing a ``with`` block
    after the exception, that is the ``with`` line, not the line that raised."""
    out = []
    while tb is not None:
        out.append(tb.tb_lineno)
        tb = tb.tb_next
    return out


def user_line(frames: list[FrameType], lines: list[int] | None = None) -> str:
    """``train.py:42 in main``: the innermost frame of the user's code (not torch, not trackdiag, not
    a library under site-packages), or "". ``lines``: each frame's line from the traceback (:func:`tb_lines`);
    without them, the frames' current lines (a stack interrupted by a signal)."""
    for i in range(len(frames) - 1, -1, -1):
        frame = frames[i]
        path = frame.f_code.co_filename
        norm = path.replace(os.sep, "/")
        if "site-packages/" in norm or "/torch/" in norm or "/trackdiag/" in norm or norm.startswith("<"):
            continue
        line = lines[i] if lines is not None and i < len(lines) else frame.f_lineno
        return f"{os.path.basename(path)}:{line} in {frame.f_code.co_name}"
    return ""


def last_points(history: Iterable[Record], last: int) -> dict[str, list[tuple[int, float]]]:
    """Per every-step series (``diag/[<c>/]loss``, ``diag/[<c>/]grad/global_norm``), its last ``last``
    points over the records in memory."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in history:
        for key, pts in record.series.items():
            if any(key.endswith(f"/{suffix}") for suffix, _ in SERIES):
                out.setdefault(key, []).extend(pts)
    return {k: sorted(dict(v).items())[-last:] for k, v in out.items()}


def series_text(points: dict[str, list[tuple[int, float]]]) -> str:
    """``loss at steps 40-49: 2.31 2.30 ... nan; grad norm at steps 40-49: 1.2 ...``."""
    parts = []
    rank = lambda k: (next(i for i, (suf, _) in enumerate(SERIES) if k.endswith(f"/{suf}")), k)  # noqa: E731
    for key, pts in sorted(points.items(), key=lambda kv: rank(kv[0])):
        if not pts:
            continue
        suffix, label = next((suf, lab) for suf, lab in SERIES if key.endswith(f"/{suf}"))
        comp = component_of(key, suffix)
        values = " ".join(f"{v:.4g}" if math.isfinite(v) else str(v) for _, v in pts)
        steps = f"{pts[0][0]}-{pts[-1][0]}" if len(pts) > 1 else f"{pts[0][0]}"
        parts.append(f"{comp + ' ' if comp else ''}{label} at steps {steps}: {values}")
    return "; ".join(parts)


def tables_of(points: dict[str, list[tuple[int, float]]]) -> dict[str, dict[str, float]]:
    """The series as record tables ``crash/<series key>`` -> {step: value} (kept in the local record
    and the trackers' tables file)."""
    return {f"crash/{k[len('diag/'):]}": {str(s): v for s, v in pts} for k, pts in points.items() if pts}


#: words of an exception about non-finite values: "nan" and "inf" as words only (autograd's in-place error suggests
#: ``set_detect_anomaly(True, check_nan=False)``; "information", "inference" are no Inf)
_NONFINITE = re.compile(r"\bnan\b|\binf\b|infinite|non-finite|nonfinite|constraint|between 0 and 1")


def nonfinite_text(exc: BaseException | None) -> bool:
    """Whether the exception talks about non-finite values (NaN/Inf or a distribution's constraint)."""
    text = f"{type(exc).__name__} {exc}".lower() if exc is not None else ""
    return _NONFINITE.search(text) is not None


def no_replay(exc: BaseException | None) -> str:
    """Why a crash must not be replayed (out of memory, a broken CUDA context), or ""."""
    if exc is None:
        return ""
    name, text = type(exc).__name__, str(exc)
    if "OutOfMemory" in name or "out of memory" in text.lower():
        return "out of memory"
    if "CUDA error" in text or "AcceleratorError" in name or "device-side assert" in text:
        return "a CUDA error"
    return ""


#: autograd's and torch.nn's errors whose traceback does not say what in the loop caused them: (a text of the
#: exception's message, the remedies)
KNOWN_ERRORS = (
    ("modified by an inplace operation",
     "A tensor autograd saved for the backward pass was changed in place between the forward and loss.backward(): use "
     "the out-of-place form (h = h + 1 for h += 1, F.relu(x) for x.relu_(), nn.ReLU(inplace=False), torch.where for "
     "x[mask] = v) or .clone() the tensor before changing it. At advanced and extreme trackdiag replays the step under "
     "anomaly detection and names the forward line that made the tensor; elsewhere torch.autograd.set_detect_anomaly(True) "
     "prints it."),
    ("backward through the graph a second time",
     "A graph from an earlier step is reused: most often a recurrent hidden state (or a running sum, a cached tensor) "
     "carried from one batch to the next without .detach(). Detach what you carry (h = h.detach() before each batch, "
     "truncated backpropagation through time), or compute the shared tensor inside the loop; retain_graph=True only if "
     "you mean to run backward twice through the same forward."),
    ("does not require grad and does not have a grad_fn",
     "The loss does not depend on anything that trains: the forward ran under torch.no_grad() or inference_mode (an "
     "evaluation context left open), the output or loss was .detach()-ed or rebuilt from .item()/.numpy() values, or "
     "every parameter has requires_grad=False (a freeze meant for the backbone only)."),
    ("Expected more than 1 value per channel when training",
     "A BatchNorm layer got a batch of one sample in train mode, usually the last, smaller batch of an epoch: "
     "DataLoader(..., drop_last=True), a batch size that divides the dataset, or model.eval() for single samples."),
)


#: PyTorch's message for a class target outside ``[0, C)`` (``cross_entropy``, ``nll_loss`` on the CPU)
_TARGET = re.compile(r"Target (-?\d+) is out of bounds")


def index_hint(exc: BaseException | None) -> str | None:
    """Remedies for an index that does not fit what it indexes, from the exception's text: a class target outside
    ``[0, C)`` (naming the target), an ``nn.Embedding`` index past its rows, a ``one_hot`` class; None otherwise."""
    text = str(exc) if exc is not None else ""
    target = _TARGET.search(text)
    if target is not None:
        n = int(target.group(1))
        if n < 0:
            cause = (f"a target of {n}: a padding or unlabelled marker the loss was not told to skip: pass it as "
                     f"ignore_index (CrossEntropyLoss(ignore_index={n}); the default skips only -100)")
        else:
            cause = (f"a target of {n} where the scores' class dimension is smaller: labels numbered 1..C instead of "
                     "0..C-1 (subtract 1, or map the label set onto 0..C-1), a last layer with fewer outputs than "
                     "there are classes (out_features = the number of classes), or a padding value past the classes "
                     "(use ignore_index)")
        return (f"A class target outside [0, C): {cause}. For scores of shape (N, T, C) the classes must be dim 1: "
                "permute to (N, C, T), or flatten both to (N*T, C) and (N*T,). Check once: "
                "assert 0 <= y.min() and y.max() < logits.shape[1].")
    if "index out of range in self" in text:
        return ("An index at or past the rows of an nn.Embedding (or a negative one): a vocabulary larger than the "
                "embedding (tokens added to the tokenizer without model.resize_token_embeddings(len(tokenizer)), "
                "vocab_size set from another tokenizer), padding ids of -1 or of the vocabulary size, position ids "
                "past max_position_embeddings (sequences longer than the model takes: truncate them). Check: "
                "assert 0 <= ids.min() and ids.max() < emb.num_embeddings.")
    if "Class values must be smaller than num_classes" in text:
        return ("one_hot got a class at or past num_classes (or a negative one): labels numbered 1..C (subtract 1), "
                "num_classes smaller than the label set, or a padding label (-1, -100) one_hot cannot take: mask it "
                "out first.")
    return None


def crash_hint(exc: BaseException | None, signalled: bool, watched: bool) -> str:
    """Remedies for a crash whose cause is not a located non-finite value (see :mod:`trackdiag.session.flight`)."""
    if signalled:
        return ("The process was killed by SIGTERM (a scheduler's time limit or pre-emption, or a kill): nothing in "
                "training need be wrong. Resume from the last checkpoint; checkpoint more often or ask for more time.")
    reason = no_replay(exc)
    if reason == "out of memory":
        return ("Out of memory: a smaller batch with gradient accumulation, activation checkpointing, bf16/fp16 "
                "autocast; if memory grew over the run (diag/mem/*), something keeps tensors alive (a loss kept "
                "without .item(), a graph retained).")
    if reason == "a CUDA error":
        return ("CUDA reports a kernel's error at a later call: the line in the traceback (and the step named here) may "
                "come after the operation that failed. Rerun with CUDA_LAUNCH_BLOCKING=1, or run the same loop on the "
                "CPU, to have the failing line raise with a readable message. A device-side assert is most often a "
                "class target outside [0, C) in cross_entropy / nll_loss (labels numbered 1..C, a head with fewer "
                "outputs than classes, a padding label without ignore_index), an index past an nn.Embedding's rows "
                "(a vocabulary larger than the embedding), or a binary_cross_entropy target outside [0, 1].")
    known = index_hint(exc) or next((hint for text, hint in KNOWN_ERRORS if exc is not None and text in str(exc)), None)
    if known is not None:
        return known
    if nonfinite_text(exc) and watched:
        return ("The exception is about non-finite values, but no module output of the step's forward held one: the "
                "NaN/Inf arose in the backward pass (an exception from autograd names the backward function: add an "
                "eps to sqrt/log/div, see the torch.where gradient trap) or outside the modules (functional ops in the "
                "loop, the loss, the data): check the batch and the ops between the model and this call.")
    if nonfinite_text(exc):
        return ("The exception is about non-finite values, and nothing watched the step's module outputs (this preset "
                "has no NaN replay and no per-module flags): rerun with level='advanced' (a replay of the step at the "
                "crash) or diag.probes.flight.modules=true to have the module named; check the batch and the ops "
                "between the model and this call.")
    return ("Not a non-finite fault: see the traceback. The last steps' loss and gradient norm (in this message and "
            "in the record) show whether training was healthy up to the crash.")
