"""Reference workloads for the overhead benchmark: a step takes roughly 5-50 ms on a 2-core CPU (the
deep narrow one ~75 ms: it is the 1,000-tensor scale case), each a learnable task.

Batches are drawn from the arm's own generator on the arm's device (``make_batch(g)`` draws on
``g.device``), so a CUDA arm pays no host-to-device copy and every arm sees the same stream.

Scaling rows: ``scale<T>`` (``scale_workload(T)``) is a residual ReLU MLP with exactly T parameter
tensors (T / 2 ``Linear`` layers) whose width shrinks as it deepens so the multiply-adds per step stay
~constant (~2^22 per sample: ~0.54 GFLOP forward at batch 64, a ~25 ms step at 10 tensors on 2 cores,
like the MLP row): the rows show how overhead grows with the tensor count
alone. No LayerNorm, so BackPACK (and the Cockpit arm) supports them. The GPT workloads are in gpt.py.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    amp: torch.dtype | None = None   # autocast dtype on CUDA (None: full precision)
    cuda_only: bool = False          # too big for a CPU benchmark
    lr: float = 1e-4
    #: several models, one optimizer each (the session gets both as dicts): ``parts(model) -> {name: module}``
    parts: Callable[[nn.Module], dict[str, nn.Module]] | None = None
    #: the step's forward and loss when it is not ``loss(model(x), y)``: ``run(model, batch) -> (loss, outputs)``
    run: Callable[[nn.Module, Any], tuple[torch.Tensor, Any]] | None = None
    #: ``diag.step(loss, outputs=..., batch=...)`` (True) or ``diag.step(loss)`` alone (False)
    step_batch: bool = True
    #: ``clip_grad_norm_(model.parameters(), clip)`` between the backward pass and the step, as nanoGPT's loop does
    #: (after ``scaler.unscale_``); None: no clipping. ``<name>+clip`` is a workload with ``clip=1.0``
    clip: float | None = None


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        block = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.pos[: idx.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10))


class _Res(nn.Module):
    def __init__(self, width: int, depth: int = 500) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.scale = 1.0 / depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.lin(x)) * self.scale  # 1/depth: stays finite however deep


def _deep_narrow(depth: int = 500, width: int = 32) -> nn.Module:
    """A healthy (residual) deep narrow MLP with 2 * depth parameter tensors: the scale budget."""
    return nn.Sequential(nn.Linear(64, width), *[_Res(width) for _ in range(depth - 2)], nn.LayerNorm(width), nn.Linear(width, 10))


def _teacher(in_features: int, classes: int = 10) -> Callable[[torch.Generator, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]]:
    """Random inputs labelled by a fixed random linear teacher: a learnable task, so the timed
    training is a healthy one (random labels kill ReLU units and trip ``dead_units``, and an alert's
    anomaly window would be timed instead of the steady state)."""
    w = torch.randn(in_features, classes, generator=torch.Generator().manual_seed(1234))
    on: dict[torch.device, torch.Tensor] = {}

    def make(g: torch.Generator, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(*shape, generator=g, device=g.device)
        wd = on.setdefault(g.device, w.to(g.device))
        return x, (x.reshape(shape[0], -1) @ wd).argmax(dim=1)

    return make


def _lm_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and a learnable target (a fixed permutation of the current token)."""
    x = torch.randint(0, 512, (8, 64), generator=g, device=g.device)
    return x, (x * 7 + 3) % 512


_mlp_data, _deep_data = _teacher(784), _teacher(64)
_PATCHES = torch.zeros(10, 3, 32, 32)
for _c in range(10):  # class c: a bright 8x8 patch at its own place of a 4x4 grid
    _PATCHES[_c, :, 8 * (_c // 4):8 * (_c // 4) + 8, 8 * (_c % 4):8 * (_c % 4) + 8] = 2.0
_PATCHES_ON: dict[torch.device, torch.Tensor] = {}


def _cnn_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise images with a class-coded bright patch: a task a small CNN learns in a few dozen steps."""
    y = torch.randint(0, 10, (32,), generator=g, device=g.device)
    patches = _PATCHES_ON.setdefault(g.device, _PATCHES.to(g.device))
    return torch.randn(32, 3, 32, 32, generator=g, device=g.device) + patches[y], y


def scale_workload(tensors: int, batch: int = 64, inputs: int = 64, macs: int = 2**22) -> Workload:
    """A residual ReLU MLP with exactly ``tensors`` parameter tensors (``tensors // 2`` Linear layers,
    weight and bias each), its width chosen so the weights hold ~``macs`` multiply-adds per sample."""
    if tensors < 6 or tensors % 2:
        raise ValueError(f"--tensors: an even count >= 6 (two per Linear layer, three layers at least), got {tensors}")
    layers = tensors // 2
    hidden = layers - 2  # (layers - 2) * w**2 + (inputs + 10) * w = macs
    width = max(8, round((-(inputs + 10) + math.sqrt((inputs + 10) ** 2 + 4 * hidden * macs)) / (2 * hidden)))

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(inputs, width), *[_Res(width, layers) for _ in range(layers - 2)], nn.Linear(width, 10))

    data = _teacher(inputs)
    return Workload(f"scale{tensors}", make, lambda g: data(g, (batch, inputs)), F.cross_entropy)


WORKLOADS = {
    "mlp": Workload("mlp", lambda: nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)),
                    lambda g: _mlp_data(g, (256, 784)), F.cross_entropy),
    "cnn": Workload("cnn", _cnn, _cnn_batch, F.cross_entropy),
    "transformer": Workload("transformer", TinyLM, _lm_batch, _ce),
    "deep_narrow": Workload("deep_narrow", _deep_narrow, lambda g: _deep_data(g, (64, 64)), F.cross_entropy),
    # a short step (~1-2 ms on 2 cores, like the example app's digits MLP): fixed costs show here
    "small": Workload("small", lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                                     nn.Linear(128, 10)), lambda g: _deep_data(g, (64, 64)), F.cross_entropy,
                      lr=1e-3),  # learns within the 100 steps not_learning waits (at 1e-4 it sat at chance: critical at 60)
    **{f"scale{t}": scale_workload(t) for t in (10, 100, 1000, 3000)},
}
#: run when --workloads is not given (gpt is added on CUDA; gpt_tiny is the CPU smoke test's)
DEFAULT = ["mlp", "cnn", "transformer", "deep_narrow", "scale10", "scale100", "scale1000", "scale3000"]
#: short steps, where fixed per-step and per-call costs show (``--workloads short``)
SHORT = ["seq2seq", "small"]


def get(name: str) -> Workload:
    """A workload by name: the table above, ``scale<T>`` for any even T >= 6, or gpt.py's; ``<name>+clip``: that
    workload, clipping its gradients to norm 1.0 every step."""
    if name.endswith("+clip"):
        return dataclasses.replace(get(name[:-5]), name=name, clip=1.0)
    if name in WORKLOADS:
        return WORKLOADS[name]
    if name.startswith("scale") and name[5:].isdigit():
        return scale_workload(int(name[5:]))
    if name == "seq2seq":
        from seq2seq import SEQ2SEQ

        return SEQ2SEQ
    from gpt import GPT_WORKLOADS

    if name in GPT_WORKLOADS:
        return GPT_WORKLOADS[name]
    raise SystemExit(f"unknown workload {name!r}: one of {sorted([*WORKLOADS, *GPT_WORKLOADS, 'seq2seq'])} or scale<T>")
