"""Draw the TTFT distributions of `vllm_e2e.py --figures N` (its ttft.json) as an SVG CDF.

    python ttft_svg.py WORK/ttft.json docs/engines-ttft.svg

Only the standard library: one polyline per side, a millisecond axis and a legend.
"""
import json
import sys

data = json.load(open(sys.argv[1]))
W, H, L, B = 640, 360, 60, 40
series = [("through serve (P/D, NixlConnector)", "#d62728", data["hop"]),
          ("decode engine alone (aggregated)", "#1f77b4", data["decode_alone"])]
xmax = max(max(v) for _, _, v in series) * 1000 * 1.05
x = lambda ms: L + (W - L - 20) * ms / xmax
y = lambda p: H - B - (H - B - 30) * p
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<text x="{W/2}" y="18" text-anchor="middle" font-size="14">TTFT, 256-token prompts, tiny model on 2 CPU cores (CDF)</text>',
       f'<line x1="{L}" y1="{H-B}" x2="{W-20}" y2="{H-B}" stroke="black"/>',
       f'<line x1="{L}" y1="{H-B}" x2="{L}" y2="30" stroke="black"/>']
step = 10 if xmax < 150 else 25 if xmax < 400 else 100
ms = 0
while ms <= xmax:
    out.append(f'<line x1="{x(ms):.1f}" y1="{H-B}" x2="{x(ms):.1f}" y2="{H-B+4}" stroke="black"/>')
    out.append(f'<text x="{x(ms):.1f}" y="{H-B+16}" text-anchor="middle">{ms}</text>')
    ms += step
out.append(f'<text x="{W/2}" y="{H-6}" text-anchor="middle">milliseconds to the first token</text>')
for p in (0, 0.5, 0.99, 1):
    out.append(f'<text x="{L-6}" y="{y(p)+4:.1f}" text-anchor="end">{p}</text>')
    out.append(f'<line x1="{L}" y1="{y(p):.1f}" x2="{W-20}" y2="{y(p):.1f}" stroke="#ddd"/>')
for i, (name, colour, values) in enumerate(series):
    values = sorted(v * 1000 for v in values)
    points = " ".join(f"{x(v):.1f},{y((k + 1) / len(values)):.1f}" for k, v in enumerate(values))
    out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
    out.append(f'<rect x="{W-300}" y="{H-B-50+18*i}" width="12" height="3" fill="{colour}"/>')
    out.append(f'<text x="{W-282}" y="{H-B-45+18*i}">{name}, n={len(values)}</text>')
out.append("</svg>")
open(sys.argv[2], "w").write("\n".join(out))
