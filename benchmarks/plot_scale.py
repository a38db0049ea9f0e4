"""The scale curve as a picture for the docs: bytes per parameter above the weights against the
parameter count (log scale), for the Fisher job (beyond its temporaries budget) and the masked 1%
train job, with the goals and the extrapolation to 1.7B and 8B. Pure Python (an SVG file, no
plotting library):

    python benchmarks/plot_scale.py   # reads benchmarks/results/bench_scale*.json, writes docs/plots/scale.svg
"""

from __future__ import annotations

import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
W, H, L, R, T, B = 640, 360, 64, 150, 24, 48  # size and margins


def _series() -> list[tuple[str, str, list[tuple[float, float]]]]:
    out = []
    fisher = json.loads((ROOT / "benchmarks/results/bench_scale.json").read_text())
    out.append(("Fisher job, beyond its budget", "#1f77b4",
                [(r["n_params"], r["bytes_per_param_beyond_budget"]) for r in fisher["rows"]]))
    train = json.loads((ROOT / "benchmarks/results/bench_scale_train.json").read_text())
    rows = [r for r in train.get("rows", []) if r.get("bytes_per_param") is not None
            or r.get("bytes_per_param_above_weights") is not None]
    pts = [(r["n_params"], r.get("bytes_per_param_above_weights", r.get("bytes_per_param"))) for r in rows]
    if pts:
        out.append(("masked 1% train job", "#d62728", pts))
    return out


def render() -> str:
    series = _series()
    xs = [x for _, _, p in series for x, _ in p] + [1.7e9, 8e9]
    x0, x1 = math.log10(min(xs)) - 0.1, math.log10(max(xs)) + 0.1
    ymax = max(8.0, max(y for _, _, p in series for _, y in p) + 1)
    sx = lambda x: L + (math.log10(x) - x0) / (x1 - x0) * (W - L - R)  # noqa: E731
    sy = lambda y: T + (1 - max(y, 0) / ymax) * (H - T - B)  # noqa: E731
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
          f'<rect width="{W}" height="{H}" fill="white"/>',
          f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
          f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>']
    for e in range(math.ceil(x0), math.floor(x1) + 1):
        x = sx(10**e)
        el.append(f'<line x1="{x:.1f}" y1="{H - B}" x2="{x:.1f}" y2="{H - B + 4}" stroke="black"/>')
        label = {7: "10M", 8: "100M", 9: "1B", 10: "10B"}.get(e, f"1e{e}")
        el.append(f'<text x="{x:.1f}" y="{H - B + 16}" text-anchor="middle">{label}</text>')
    for y in range(0, int(ymax) + 1, 2):
        el.append(f'<text x="{L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y}</text>')
        el.append(f'<line x1="{L}" y1="{sy(y):.1f}" x2="{W - R}" y2="{sy(y):.1f}" stroke="#eee"/>')
    el.append(f'<text x="{(L + W - R) / 2}" y="{H - 10}" text-anchor="middle">parameters (log scale)</text>')
    el.append(f'<text x="14" y="{(T + H - B) / 2}" transform="rotate(-90 14 {(T + H - B) / 2})" '
              'text-anchor="middle">bytes/param above the weights</text>')
    for goal, color, name in ((6, "#1f77b4", "Fisher goal 6"), (3, "#d62728", "train goal 3")):
        el.append(f'<line x1="{L}" y1="{sy(goal):.1f}" x2="{W - R}" y2="{sy(goal):.1f}" stroke="{color}" '
                  'stroke-dasharray="4 3"/>')
        el.append(f'<text x="{W - R + 4}" y="{sy(goal) + 4:.1f}" fill="{color}">{name}</text>')
    for x, name in ((1.7e9, "1.7B"), (8e9, "8B")):
        el.append(f'<line x1="{sx(x):.1f}" y1="{T}" x2="{sx(x):.1f}" y2="{H - B}" stroke="#999" stroke-dasharray="2 3"/>')
        el.append(f'<text x="{sx(x):.1f}" y="{T - 6}" text-anchor="middle" fill="#666">{name}</text>')
    for i, (name, color, pts) in enumerate(series):
        pts = sorted(pts)
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        el.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in pts:
            el.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>')
        # the extrapolation: the last measured value held to 8B (the parts that scale per
        # parameter are the accumulators / optimizer state; the rest shrinks with size)
        xl, yl = pts[-1]
        el.append(f'<line x1="{sx(xl):.1f}" y1="{sy(yl):.1f}" x2="{sx(8e9):.1f}" y2="{sy(yl):.1f}" '
                  f'stroke="{color}" stroke-dasharray="6 4"/>')
        el.append(f'<text x="{W - R + 4}" y="{T + 14 + 14 * i}" fill="{color}">{name}</text>')
    el.append(f'<text x="{W - R + 4}" y="{T + 14 + 14 * len(series)}" fill="#666">dashed: held to 8B</text>')
    el.append("</svg>")
    return "\n".join(el) + "\n"


def main() -> int:
    out = ROOT / "docs/plots/scale.svg"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
