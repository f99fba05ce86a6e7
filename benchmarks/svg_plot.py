"""A self-contained SVG line chart (no plotting library on the GPU machine): series of (x, y) points, linear axes
with round tick values, a legend; solid or dashed lines. Used by benchmarks/compact_quality.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    color: str = COLORS[0]
    dashed: bool = False


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    unit = 10 ** math.floor(math.log10(raw))
    step = next(m * unit for m in (1, 2, 5, 10) if m * unit >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def line_chart(series: list[Series], *, title: str, xlabel: str, ylabel: str, ylim: tuple[float, float] | None = None,
               width: int = 760, height: int = 420) -> str:
    """The SVG document of ``series`` on one pair of axes; points outside ``ylim`` (default: the data's range) are
    clipped to the plot area. Non-finite points are skipped; a series with an empty label has no legend entry."""
    pts = [(x, y) for s in series for x, y in zip(s.xs, s.ys) if math.isfinite(y)]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = ylim or (min(p[1] for p in pts), max(p[1] for p in pts))
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    left, right, top, bottom = 64, 210, 34, 46  # margins: tick labels, legend, title, axis label
    pw, ph = width - left - right, height - top - bottom
    sx = lambda x: left + (x - x0) / (x1 - x0) * pw
    sy = lambda y: top + (1 - (min(max(y, y0), y1) - y0) / (y1 - y0)) * ph
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left + pw / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle">{escape(xlabel)}</text>',
           f'<text x="14" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 14 {top + ph / 2})">'
           f'{escape(ylabel)}</text>']
    for t in ticks(x0, x1):
        out.append(f'<line x1="{sx(t):.1f}" y1="{top}" x2="{sx(t):.1f}" y2="{top + ph}" stroke="#e5e5e5"/>'
                   f'<text x="{sx(t):.1f}" y="{top + ph + 16}" text-anchor="middle">{t:g}</text>')
    for t in ticks(y0, y1):
        out.append(f'<line x1="{left}" y1="{sy(t):.1f}" x2="{left + pw}" y2="{sy(t):.1f}" stroke="#e5e5e5"/>'
                   f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    for i, s in enumerate(series):
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(s.xs, s.ys) if math.isfinite(y))
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="1.5"{dash}/>')
        if not s.label:  # no legend entry
            continue
        ly = top + 10 + 18 * sum(1 for t in series[:i] if t.label)
        out.append(f'<line x1="{left + pw + 10}" y1="{ly}" x2="{left + pw + 34}" y2="{ly}" stroke="{s.color}" '
                   f'stroke-width="2"{dash}/><text x="{left + pw + 40}" y="{ly + 4}">{escape(s.label)}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"
