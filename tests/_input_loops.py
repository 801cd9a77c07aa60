"""Loops that optimise an input, not the model (issue 47 item 8), integrated as a README user would.

- ``style_transfer``: a faithful small copy of PyTorch's neural-style tutorial (pytorch/examples,
  tutorials' ``neural_style_tutorial``): a small conv net standing in for VGG's features (weights fixed by a
  seed, left ``requires_grad=True`` as the tutorial's older version does, so backward fills their ``.grad``),
  ``Normalization``, ``ContentLoss``/``StyleLoss`` modules inserted after the convs, the net cut after the
  last loss, ``optimizer = LBFGS([input_img])`` (defaults: lr=1, max_iter=20), the closure clamping
  ``input_img.data.clamp_(0, 1)``, ``style_weight=1e6``, ``content_weight=1``.
- ``feature_vis``: feature visualisation / deep-dream style: ``Adam([img], lr=0.05)`` steps an image to
  maximise one channel's mean activation (a forward hook reads it) with an L2 and total-variation penalty,
  the image clamped to [0, 1] after each step.

Both hand the stepped image to ``diag.step`` as the batch. Fault ``lr1000``: the optimizer's lr x1000 from
``onset``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from _zoo_a import quiet_probes

import trackdiag


def _images(seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth 'content' picture and a striped 'style' picture in [0, 1], shape (1, 3, size, size)."""
    gen = torch.Generator().manual_seed(seed)
    lo = torch.rand(1, 3, 4, 4, generator=gen)
    content = F.interpolate(lo, size=(size, size), mode="bilinear", align_corners=False)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    phase = torch.rand(3, 1, 1, generator=gen) * 6.28
    style = 0.5 + 0.5 * torch.sin((xx + yy)[None] * 0.8 + phase)
    return content.clamp(0, 1), style[None].clamp(0, 1)


def _features(seed: int) -> nn.Sequential:
    """The 'pretrained' feature extractor: five 3x3 convs, ReLUs and one max-pool (fixed weights)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1)).eval()


class ContentLoss(nn.Module):
    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.target = target.detach()
        self.loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.loss = F.mse_loss(x, self.target)
        return x


def gram_matrix(x: torch.Tensor) -> torch.Tensor:
    a, b, c, d = x.size()
    feats = x.view(a * b, c * d)
    return torch.mm(feats, feats.t()).div(a * b * c * d)


class StyleLoss(nn.Module):
    def __init__(self, target_feature: torch.Tensor) -> None:
        super().__init__()
        self.target = gram_matrix(target_feature).detach()
        self.loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.loss = F.mse_loss(gram_matrix(x), self.target)
        return x


class Normalization(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(-1, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(-1, 1, 1))

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return (img - self.mean) / self.std


def style_model_and_losses(cnn: nn.Sequential, style_img: torch.Tensor, content_img: torch.Tensor,
                           content_layers: tuple[str, ...] = ("conv_4",),
                           style_layers: tuple[str, ...] = ("conv_1", "conv_2", "conv_3", "conv_4", "conv_5"),
                           ) -> tuple[nn.Sequential, list[StyleLoss], list[ContentLoss]]:
    """The tutorial's ``get_style_model_and_losses``: loss modules inserted after the named convs."""
    model = nn.Sequential(Normalization())
    content_losses, style_losses = [], []
    i = 0
    for layer in cnn.children():
        if isinstance(layer, nn.Conv2d):
            i += 1
            name = f"conv_{i}"
        elif isinstance(layer, nn.ReLU):
            name, layer = f"relu_{i}", nn.ReLU(inplace=False)
        elif isinstance(layer, nn.MaxPool2d):
            name = f"pool_{i}"
        else:
            raise RuntimeError(f"unrecognised layer {layer}")
        model.add_module(name, layer)
        if name in content_layers:
            target = model(content_img).detach()
            content_losses.append(ContentLoss(target))
            model.add_module(f"content_loss_{i}", content_losses[-1])
        if name in style_layers:
            target_feature = model(style_img).detach()
            style_losses.append(StyleLoss(target_feature))
            model.add_module(f"style_loss_{i}", style_losses[-1])
    for j in range(len(model) - 1, -1, -1):
        if isinstance(model[j], (ContentLoss, StyleLoss)):
            break
    return model[: j + 1], style_losses, content_losses


def session(model: nn.Module, opt: Any, out: Path | str, level: str, **overrides: Any) -> trackdiag.Diagnostics:
    """``Diagnostics`` as the README's quick start builds it (local record only, end-of-run artifacts off)."""
    probes = quiet_probes(**overrides.pop("probes", {}))
    return trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(out), probes=probes,
                                 **overrides)


def style_transfer(out: Path | str, *, level: str = "advanced", seed: int = 0, steps: int = 60,
                   fault: str | None = None, onset: int = 30, **overrides: Any) -> tuple[Any, torch.Tensor]:
    """The tutorial's ``run_style_transfer`` with ``diag.step`` after each ``optimizer.step(closure)``;
    returns the closed session and the final image."""
    content_img, style_img = _images(seed)
    cnn = _features(seed)
    model, style_losses, content_losses = style_model_and_losses(cnn, style_img, content_img)
    input_img = content_img.clone()
    input_img.requires_grad_(True)
    model.eval()
    optimizer = torch.optim.LBFGS([input_img])
    diag = session(model, optimizer, out, level, **overrides)
    with diag:
        for step in range(steps):
            if fault == "lr1000" and step == onset:
                for g in optimizer.param_groups:
                    g["lr"] *= 1000.0

            def closure() -> torch.Tensor:
                input_img.data.clamp_(0, 1)
                optimizer.zero_grad()
                model(input_img)
                style_score = sum(sl.loss for sl in style_losses) * 1e6
                content_score = sum(cl.loss for cl in content_losses) * 1.0
                loss = style_score + content_score
                loss.backward()
                return style_score + content_score

            loss = optimizer.step(closure)
            diag.step(loss=loss, batch=input_img)
    input_img.data.clamp_(0, 1)
    return diag, input_img.detach()


def feature_vis(out: Path | str, *, level: str = "advanced", seed: int = 0, steps: int = 200,
                fault: str | None = None, onset: int = 100, **overrides: Any) -> tuple[Any, torch.Tensor]:
    """Activation maximisation of channel 5 of the last conv by stepping the input with Adam."""
    model = _features(seed)
    seen: dict[str, torch.Tensor] = {}
    model[-1].register_forward_hook(lambda m, i, o: seen.__setitem__("act", o))
    gen = torch.Generator().manual_seed(seed)
    img = (0.5 + 0.1 * torch.randn(1, 3, 32, 32, generator=gen)).clamp(0, 1).requires_grad_(True)
    optimizer = torch.optim.Adam([img], lr=0.05)
    diag = session(model, optimizer, out, level, **overrides)
    with diag:
        for step in range(steps):
            if fault == "lr1000" and step == onset:
                for g in optimizer.param_groups:
                    g["lr"] *= 1000.0
            optimizer.zero_grad()
            model(img)
            act = seen["act"][0, 5].mean()
            tv = (img[..., 1:, :] - img[..., :-1, :]).abs().mean() + (img[..., 1:] - img[..., :-1]).abs().mean()
            loss = -act + 0.05 * tv + 0.01 * img.pow(2).mean()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                img.clamp_(0, 1)
            diag.step(loss=loss, batch=img)
    return diag, img.detach()
