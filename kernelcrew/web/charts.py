"""The job page's charts as inline SVG, drawn on the server from the report's own numbers.

Roofline: x is the task's arithmetic intensity (its compulsory FLOPs over its compulsory bytes, the
work every correct candidate must do, so one x for all), y the throughput that work reaches at each
measured time; the roofs are the device's DRAM bandwidth and its peak for the task's compute class.
Time per iteration: each step's measured time, with eager, ``torch.compile`` and the floor as lines.
Where the numbers do not exist (a CPU has no published peaks) the chart says why instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup, escape

WIDTH, HEIGHT = 860, 380
LEFT, RIGHT, TOP, BOTTOM = 78, 250, 18, 48
LABEL_GAP = 15


@dataclass
class Chart:
    """An SVG, or the reason there is none."""

    svg: Markup | None = None
    reason: str = ""


@dataclass
class Series:
    """One measured point: a label and its time in milliseconds."""

    label: str
    ms: float
    ok: bool = True


class LogScale:
    """Maps values on a log axis to pixels between ``lo_px`` and ``hi_px``."""

    def __init__(self, vmin: float, vmax: float, lo_px: float, hi_px: float) -> None:
        self.a = math.floor(math.log10(vmin))
        self.b = max(math.ceil(math.log10(vmax)), self.a + 1)
        self.lo_px, self.hi_px = lo_px, hi_px

    def __call__(self, v: float) -> float:
        t = (math.log10(v) - self.a) / (self.b - self.a)
        return self.lo_px + t * (self.hi_px - self.lo_px)

    def ticks(self) -> list[float]:
        decades = [10.0**k for k in range(self.a, self.b + 1)]
        if len(decades) > 3:
            return decades
        return sorted(d * m for d in decades for m in (1, 2, 5) if d * m <= 10.0**self.b)


def si(v: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= factor:
            return f"{v / factor:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}"


def _text(x: float, y: float, s: str, cls: str = "", anchor: str = "start") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" class="{cls}" text-anchor="{anchor}">{escape(s)}</text>'


def _axes(
    x_scale: LogScale | None, y_scale: LogScale, x_fmt: Any, y_fmt: Any, titles: tuple[str, str]
) -> list[str]:
    """Frame, grid lines, tick labels and axis titles."""
    x0, x1, y0, y1 = LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP
    parts = [f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" class="frame"/>']
    for v in y_scale.ticks():
        y = y_scale(v)
        parts.append(f'<line x1="{x0}" x2="{x1}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(_text(x0 - 6, y + 4, y_fmt(v), "tick", "end"))
    if x_scale is not None:
        for v in x_scale.ticks():
            x = x_scale(v)
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y0}" y2="{y1}" class="grid"/>')
            parts.append(_text(x, y0 + 16, x_fmt(v), "tick", "middle"))
    parts.append(_text((x0 + x1) / 2, HEIGHT - 8, titles[0], "axis", "middle"))
    parts.append(
        f'<text transform="translate(14 {(y0 + y1) / 2:.0f}) rotate(-90)" class="axis" '
        f'text-anchor="middle">{escape(titles[1])}</text>'
    )
    return parts


def _labels(points: Iterable[tuple[float, float, str, str]]) -> list[str]:
    """Labels in the right margin, spread apart vertically, each with a leader to its point."""
    placed: list[str] = []
    last = -math.inf
    for x, y, label, cls in sorted(points, key=lambda p: p[1]):
        ly = max(y, last + LABEL_GAP)
        last = ly
        lx = WIDTH - RIGHT + 8
        placed.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{lx - 2}" y2="{ly:.1f}" class="leader"/>')
        placed.append(_text(lx, ly + 4, label, f"plabel {cls}"))
    return placed


def _svg(parts: Sequence[str], title: str) -> Markup:
    body = "".join(parts)
    return Markup(
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" class="chart">'
        f"<title>{escape(title)}</title>{body}</svg>"
    )


def roofline_chart(report: dict[str, Any]) -> Chart:
    """Roofline of the reference, the ``torch.compile`` baselines and every timed candidate."""
    roof = report.get("roofline") or {}
    floor = roof.get("floor") or {}
    if not floor.get("floor_ms"):
        why = floor.get("reason") or "the report has no peak figures for it"
        return Chart(reason=f"Not available on this device because {why}: a roofline needs its peaks.")
    flops, nbytes = floor.get("flops") or 0.0, floor.get("bytes") or 0.0
    if flops <= 0 or nbytes <= 0:
        return Chart(reason="Not available: the task does no floating-point work, so it has no intensity.")
    bandwidth = floor["dram_gbs"] * 1e9
    peak = floor["compute_tflops"] * 1e12
    intensity = flops / nbytes
    points = measured_points(report)
    if not points:
        return Chart(reason="Not available: nothing was timed on this device.")
    ridge = peak / bandwidth
    throughput = [flops / (p.ms / 1e3) for p in points]
    xs = LogScale(min(intensity, ridge) / 30, max(intensity, ridge) * 30, LEFT, WIDTH - RIGHT)
    y_lo = min(min(throughput), bandwidth * 10.0**xs.a)
    ys = LogScale(y_lo / 2, peak * 2, HEIGHT - BOTTOM, TOP)
    x_min, x_max = 10.0**xs.a, 10.0**xs.b
    mem_end = min(ridge, x_max)
    roofs = [
        f'<polyline class="roof" points="{xs(x_min):.1f},{ys(max(bandwidth * x_min, 10.0**ys.a)):.1f} '
        f'{xs(mem_end):.1f},{ys(bandwidth * mem_end):.1f} {xs(x_max):.1f},{ys(peak):.1f}"/>',
        _text(
            xs(x_max) - 4,
            ys(peak) - 6,
            f"{floor['compute_class']} peak {si(peak, 'FLOP/s')}",
            "rooflabel",
            "end",
        ),
        _text(
            xs(x_min) + 6,
            ys(max(bandwidth * x_min, 10.0**ys.a)) - 8,
            f"DRAM {floor['dram_gbs']:g} GB/s",
            "rooflabel",
        ),
        f'<line x1="{xs(intensity):.1f}" x2="{xs(intensity):.1f}" y1="{HEIGHT - BOTTOM}" y2="{TOP}" class="marker"/>',
    ]
    dots, labels = [], []
    for p, y_value in zip(points, throughput, strict=True):
        cx, cy = xs(intensity), ys(y_value)
        cls = "ref" if p.label == "eager" or p.label.startswith("torch.compile") else "cand"
        dots.append(
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4.5" class="dot {cls}"><title>{escape(p.label)}: '
            f"{escape(si(y_value, 'FLOP/s'))} at {p.ms:.4g} ms</title></circle>"
        )
        labels.append((cx, cy, f"{p.label} {si(y_value, 'FLOP/s')}", cls))
    parts = _axes(
        xs,
        ys,
        lambda v: f"{v:g}",
        lambda v: si(v, "FLOP/s"),
        ("arithmetic intensity (FLOP / byte, log)", "throughput (log)"),
    )
    title = f"Roofline: intensity {intensity:.3g} FLOP/byte, ridge at {ridge:.3g}"
    return Chart(svg=_svg([*parts, *roofs, *dots, *_labels(labels)], title))


def measured_points(report: dict[str, Any]) -> list[Series]:
    """Eager and ``torch.compile`` from the final measurement, then each step's candidate time."""
    best = report.get("best") or {}
    base = report.get("baseline") or {}
    points = []
    eager_ms = best.get("eager_ms") or base.get("eager_ms")
    if eager_ms:
        points.append(Series("eager", eager_ms))
    for mode, ms in (best.get("compile_ms") or base.get("compile_ms") or {}).items():
        if ms:
            points.append(Series(f"torch.compile {mode}", ms))
    for it in report.get("iterations") or []:
        if it.get("verdict") == "pass" and it.get("time_ms"):
            points.append(Series(f"{it.get('id')} {it.get('strategy')}", it["time_ms"]))
    return points


def time_chart(steps: Sequence[tuple[int, Series | None]], references: Sequence[Series]) -> Chart:
    """Time of each step's candidate (log ms) with the references as horizontal lines."""
    timed = [s.ms for _, s in steps if s is not None and s.ok]
    values = timed + [r.ms for r in references]
    if not values:
        return Chart(reason="No timings yet: the chart fills in as candidates are measured.")
    ys = LogScale(min(values) / 1.5, max(values) * 1.5, HEIGHT - BOTTOM, TOP)
    n = max(len(steps), 1)
    x0, x1 = LEFT + 30, WIDTH - RIGHT - 30

    def x_of(i: int) -> float:
        return x0 + (x1 - x0) * (i / (n - 1) if n > 1 else 0.5)

    parts = _axes(None, ys, None, lambda v: f"{v:g} ms", ("step", "time per call (ms, log)"))
    labels = []
    for r in references:
        y = ys(r.ms)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="refline"/>')
        labels.append((WIDTH - RIGHT, y, f"{r.label} {r.ms:.4g} ms", "ref"))
    line, dots = [], []
    for i, (step, s) in enumerate(steps):
        x = x_of(i)
        parts.append(_text(x, HEIGHT - BOTTOM + 16, str(step), "tick", "middle"))
        if s is None:
            continue
        if not s.ok:
            y = HEIGHT - BOTTOM - 10
            parts.append(
                f'<text x="{x:.1f}" y="{y:.1f}" class="failmark" text-anchor="middle">✕<title>'
                f"step {step}: {escape(s.label)} failed</title></text>"
            )
            continue
        y = ys(s.ms)
        line.append(f"{x:.1f},{y:.1f}")
        dots.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" class="dot cand"><title>step {step}: '
            f"{escape(s.label)} {s.ms:.4g} ms</title></circle>"
        )
        dots.append(_text(x + 8, y - 8, f"{s.ms:.3g} ms", "plabel"))
    if len(line) > 1:
        parts.append(f'<polyline class="series" points="{" ".join(line)}"/>')
    parts += dots
    title = "Time per iteration: each step's candidate against the references"
    return Chart(svg=_svg([*parts, *_labels(labels)], title))


__all__ = ["Chart", "Series", "measured_points", "roofline_chart", "time_chart"]
