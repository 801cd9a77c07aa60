"""A histogram drawn straight into pixels: the per-step images the MLflow sink logs beside each histogram.

MLflow's image cards show a 256 px thumbnail of each ``log_image`` step, so a histogram's picture is small and
always the same: a title (the key, the step), filled bins over a box with a few ticks, and a red note when values
pile up in the end bins (out of range, NaN/Inf). Drawing it with numpy (the bins, the box) and Pillow (the text;
MLflow needs Pillow for ``log_image`` anyway) costs ~1-2 ms an image; matplotlib's Agg canvas cost ~25-50 ms an
image plus ~0.6 s to import, in the delivery worker beside training: an ``advanced`` run of 300 steps logs ~36 of
them (~2 CPU-s of its worker before, ~0.1 s now).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import numpy as np

log = logging.getLogger("trackdiag")

SIZE = 256
#: the plot box in pixels: left, top, right, bottom (room for the title above, the tick labels left and below)
BOX = (52, 56, 244, 214)
BAR = (99, 157, 200)     # matplotlib's first colour (#1f77b4) at alpha 0.75 over white, as the cards looked before
INK, GREY, RED = (0, 0, 0), (90, 90, 90), (203, 24, 29)
TITLE_CHARS = 40  # what fits the 256 px width; longer keys keep their end (the layer's name)


def nice_ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """At most ``most`` round values in ``[lo, hi]`` a step of 1, 2, 2.5 or 5 times a power of ten apart."""
    span = hi - lo
    if not (math.isfinite(span) and span > 0):
        return [lo] if math.isfinite(lo) else []
    raw = span / max(most - 1, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(lo / step - 1e-9)
    ticks = [(first + i) * step for i in range(int(math.floor(hi / step + 1e-9)) - first + 1)]
    return [0.0 if abs(t) < step * 1e-9 else t for t in ticks][: most + 1]


def tick_labels(ticks: Sequence[float]) -> tuple[list[str], str]:
    """Labels for ``ticks`` and the axis' power-of-ten note: scientific past 1e-2 and 1e3, as matplotlib's
    ``ticklabel_format(style="sci", scilimits=(-2, 3))`` writes them (``1e-05`` under the axis, ``2.5`` at a tick)."""
    top = max((abs(t) for t in ticks), default=0.0)
    power = math.floor(math.log10(top)) if top > 0 else 0
    if -2 <= power <= 3:
        return [f"{t:.4g}" for t in ticks], ""
    return [f"{t / 10.0 ** power:.3g}" for t in ticks], f"1e{power}"


class HistogramRenderer:
    """Draws a histogram into a ``(256, 256, 3)`` uint8 array for ``MlflowClient.log_image``; runs in the delivery
    worker (or ``trackdiag sync``). ``available`` turns False when Pillow is missing (then only the JSON data is
    logged, with one info line)."""

    def __init__(self) -> None:
        self._fonts: Any = None
        self.available = True

    def _load(self) -> Any:
        if self._fonts is None:
            try:
                from PIL import Image, ImageDraw, ImageFont
            except ImportError:
                self.available = False
                log.info("trackdiag: Pillow not installed; MLflow gets histogram data (JSON) without images")
                return None
            try:  # Pillow >= 10.1 with FreeType: a scalable font; else its bitmap one
                fonts = ImageFont.load_default(size=11), ImageFont.load_default(size=9)
            except (TypeError, OSError):
                fonts = ImageFont.load_default(), ImageFont.load_default()
            self._fonts = (Image, ImageDraw, *fonts)
        return self._fonts

    def to_array(self, title: str, edges: list[float], counts: list[float], step: int) -> Any:
        """An ``(H, W, 3)`` uint8 image of the histogram, or None (unavailable, bad data)."""
        parts = self._load() if self.available else None
        if parts is None or len(edges) != len(counts) + 1 or not counts:
            return None
        try:
            return self._draw(parts, title, [float(e) for e in edges], [float(c) for c in counts], step)
        except Exception as exc:  # odd data must not stop delivery
            log.debug("trackdiag: histogram %s at step %d not rendered: %s", title, step, exc)
            return None

    def _draw(self, parts: Any, title: str, edges: list[float], counts: list[float], step: int) -> np.ndarray:
        image_mod, draw_mod, big, small = parts
        lo, hi = edges[0], edges[-1]
        if not all(math.isfinite(v) for v in (lo, hi, *counts)):
            raise ValueError("non-finite edges or counts")
        pad = 0.02 * (hi - lo) if hi > lo else 0.5
        xlo, xhi = lo - pad, hi + pad
        ytop = 1.05 * max(max(counts), 1.0)
        left, top, right, bottom = BOX
        px = lambda v: left + (v - xlo) / (xhi - xlo) * (right - left)  # noqa: E731
        py = lambda v: bottom - v / ytop * (bottom - top)  # noqa: E731

        img = np.full((SIZE, SIZE, 3), 255, dtype=np.uint8)
        # the bins: each pixel column inside the box takes the count of the bin its centre falls in
        cols = np.arange(left + 1, right)
        data_x = xlo + (cols + 0.5 - left) / (right - left) * (xhi - xlo)
        e = np.asarray(edges)
        which = np.searchsorted(e, data_x, side="right") - 1
        inside = (which >= 0) & (which < len(counts)) & (data_x <= hi)
        heights = np.where(inside, np.asarray(counts)[np.clip(which, 0, len(counts) - 1)], 0.0)
        tops = np.ceil(bottom - heights / ytop * (bottom - top)).astype(int)
        rows = np.arange(top + 1, bottom)[:, None]
        fill = (rows >= tops[None, :]) & (heights[None, :] > 0)
        region = img[top + 1:bottom, left + 1:right]
        region[fill] = BAR

        pil = image_mod.fromarray(img)
        d = draw_mod.Draw(pil)
        d.rectangle((left, top, right, bottom), outline=INK, width=1)
        for axis, ticks in (("x", nice_ticks(xlo, xhi)), ("y", nice_ticks(0.0, ytop))):
            labels, power = tick_labels(ticks)
            for t, text in zip(ticks, labels):
                if axis == "x":
                    x = round(px(t))
                    d.line((x, bottom, x, bottom + 3), fill=INK)
                    d.text((x, bottom + 5), text, fill=INK, font=small, anchor="ma")
                else:
                    y = round(py(t))
                    d.line((left - 3, y, left, y), fill=INK)
                    d.text((left - 5, y), text, fill=INK, font=small, anchor="rm")
            if power and axis == "x":
                d.text((right, bottom + 18), power, fill=INK, font=small, anchor="ra")
            elif power:
                d.text((left, top - 3), power, fill=INK, font=small, anchor="ld")
        label = image_mod.new("RGB", (40, 12), "white")
        draw_mod.Draw(label).text((20, 6), "count", fill=GREY, font=small, anchor="mm")
        pil.paste(label.rotate(90, expand=True), (4, (top + bottom) // 2 - 20))

        short = title.removeprefix("diag/")
        if len(short) > TITLE_CHARS:
            short = "…" + short[-(TITLE_CHARS - 1):]
        d.multiline_text((SIZE // 2, 8), f"{short}\nstep {step}", fill=INK, font=big, anchor="ma", align="center",
                         spacing=3)
        total, ends = sum(counts), counts[0] + counts[-1]
        if total > 0 and ends > 0.25 * total:  # clamped values (out of range, NaN/Inf) pile up at the ends
            d.multiline_text(((left + right) // 2, top + 8), f"{ends / total:.0%} in the end bins\n(out of range or NaN/Inf)",
                             fill=RED, font=small, anchor="ma", align="center", spacing=2)
        return np.asarray(pil, dtype=np.uint8).copy()
