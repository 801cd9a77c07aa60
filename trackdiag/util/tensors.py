"""Helpers shared by the data checks, the NaN replay and the pre-flight: walking the tensors of a
batch or of a model output, picking the targets out of a batch, and hooks that do not drag the
diagnostics session along when the user deep-copies the model (EMA copies, pre-flight).

Batch conventions (documented in the README): a batch is a tensor, a sequence ``(inputs, targets,
...)`` or a mapping. The model input is the tensor itself, ``batch[0]``, or (mapping) the value under
the first of ``input``/``inputs``/``x``/``image``/``images``/``input_ids``. The targets are ``batch[1]``
or the value under the first of ``target``/``targets``/``label``/``labels``/``y``; a ``target`` option
(index or key) overrides the guess. Host-side only: nothing here reads a tensor's values.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

TARGET_KEYS = ("target", "targets", "label", "labels", "y")
INPUT_KEYS = ("input", "inputs", "x", "image", "images", "input_ids")


def iter_tensors(obj: Any, path: str = "batch", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` (tensors, sequences, mappings, dataclass-like objects with
    ``__dict__`` are walked 4 levels deep) with a readable path: ``batch[0]``, ``batch['image']``."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif depth >= 4 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{path}[{k!r}]", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}[{i}]", depth + 1)


def float_tensors(obj: Any, path: str = "batch") -> list[tuple[str, torch.Tensor]]:
    """The floating-point (and complex) tensors of ``obj``: the ones that can hold NaN/Inf."""
    return [(p, t) for p, t in iter_tensors(obj, path) if t.is_floating_point() or t.is_complex()]


def pick(batch: Any, key: int | str | None, guesses: tuple[str, ...], index: int) -> Any:
    """``batch[key]`` when ``key`` is given (``None`` if absent); else the first guessed key of a
    mapping or ``batch[index]`` of a sequence; ``None`` when the batch has no such part."""
    if key is not None:
        try:
            return batch[key]
        except (KeyError, IndexError, TypeError):
            return None
    if type(batch) in (tuple, list):  # the usual ``(x, y)``: before the slower Mapping test
        return batch[index] if len(batch) > index else None
    if isinstance(batch, Mapping):
        return next((batch[k] for k in guesses if k in batch), None)
    if isinstance(batch, (list, tuple)) and len(batch) > index:
        return batch[index]
    return None


def targets_of(batch: Any, key: int | str | None = None) -> torch.Tensor | None:
    """The integer class targets of ``batch`` (see module docstring), or ``None``."""
    t = pick(batch, key, TARGET_KEYS, 1)
    if isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
        return t
    return None


def inputs_of(batch: Any) -> Any:
    """The model input of ``batch``: the tensor itself, ``batch[0]``, or a guessed mapping key."""
    if isinstance(batch, torch.Tensor):
        return batch
    got = pick(batch, None, INPUT_KEYS, 0)
    return batch if got is None else got


def logits_of(outputs: Any, key: int | str | None = None) -> torch.Tensor | None:
    """The class-score tensor of a model output: the tensor itself, ``outputs[key]``, a ``logits``
    attribute or key, or the first floating tensor of a sequence."""
    if key is not None:
        outputs = pick(outputs, key, (), 0)
    if isinstance(outputs, torch.Tensor):
        return outputs if outputs.is_floating_point() else None
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    return next((t for _, t in float_tensors(outputs, "out")), None)


def class_dim(logits: torch.Tensor, targets: torch.Tensor) -> int | None:
    """The class dimension of ``logits`` for class-index ``targets``: -1 for ``(N, C)``/``(B, T, C)``
    scores with ``(N,)``/``(B, T)`` targets, 1 for ``(N, C, H, W)`` with ``(N, H, W)``; None when the
    shapes do not pair up (then the number of classes is unknown and nothing is checked)."""
    if logits.dim() != targets.dim() + 1 or logits.dim() < 2:
        return None
    if logits.shape[:-1] == targets.shape:
        return -1
    if logits.shape[0] == targets.shape[0] and logits.shape[2:] == targets.shape[1:]:
        return 1
    return None


#: the smallest single target value above the classes taken as padding (segmentation's void 255; not the
#: class count itself, which is what 1-based labels produce)
HIGH_IGNORE = 250


def default_loss(outputs: Any, batch: Any, target: int | str | None = None) -> torch.Tensor | None:
    """Cross-entropy when the batch holds class targets that pair with the output's shape (padding
    targets ignored), MSE when it holds float targets of the output's shape, else ``None`` (no loss
    can be guessed). Reads the targets' extremes back: replay and pre-flight paths only."""
    logits = logits_of(outputs)
    if logits is None:
        return None
    t = targets_of(batch, target)
    if t is not None:
        dim = class_dim(logits, t)
        if dim is None:
            return None
        # padding targets (one negative value: -100 or the -1 many scripts use; or segmentation's void label, 255,
        # above the classes) are ignored, as the user's loss does; reading the extremes is a host read, fine on
        # the replay/pre-flight paths that call this
        low, high = (int(v) for v in t.aminmax()) if t.numel() else (0, 0)
        ignore = low if low < 0 else high if high >= max(HIGH_IGNORE, logits.shape[dim]) else -100
        if dim == -1:
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), t.reshape(-1),
                                                     ignore_index=ignore)
        if dim == 1:
            return torch.nn.functional.cross_entropy(logits.float(), t, ignore_index=ignore)
        return None
    y = pick(batch, target, TARGET_KEYS, 1)
    if isinstance(y, torch.Tensor) and y.is_floating_point() and y.shape == logits.shape:
        return torch.nn.functional.mse_loss(logits.float(), y.float())
    return None


def _noop(*_: Any, **__: Any) -> None:
    return None


def _make_noop() -> Callable[..., None]:
    return _noop


class SafeHook:
    """A hook callable that turns into a no-op in a deep copy of the module it is registered on,
    so ``copy.deepcopy(model)`` (EMA models, the pre-flight) never copies the diagnostics with it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _noop

    def __reduce__(self) -> tuple[Any, tuple[()]]:  # pickling a hooked model (torch.save) drops it too
        return (_make_noop, ())
