"""The loss curve as a PNG, drawn with numpy and written with zlib (no plotting library).

Train loss is a blue polyline, eval loss red dots with a line; axes are light grey lines
with the loss range written nowhere (PNG text needs fonts): OUT/metrics.jsonl has the numbers.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np

W, H, PAD = 720, 400, 30
BLUE, RED, GREY = (31, 119, 180), (214, 39, 40), (200, 200, 200)


def _png(img: np.ndarray) -> bytes:
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(img.shape[0]))
    chunk = lambda tag, data: struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    head = struct.pack(">IIBBBBB", img.shape[1], img.shape[0], 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _line(img, p, q, color, width=2):
    n = int(max(abs(q[0] - p[0]), abs(q[1] - p[1]))) + 1
    xs = np.linspace(p[0], q[0], n).round().astype(int)
    ys = np.linspace(p[1], q[1], n).round().astype(int)
    for dx in range(width):
        for dy in range(width):
            img[np.clip(ys + dy, 0, H - 1), np.clip(xs + dx, 0, W - 1)] = color


def plot_metrics(metrics_path, png_path) -> Path:
    train, evals = [], []
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and np.isfinite(r["loss"]):
            train.append((r["step"], r["loss"]))
        if "eval_loss" in r and np.isfinite(r["eval_loss"]):
            evals.append((r["step"], r["eval_loss"]))
    img = np.full((H, W, 3), 255, np.uint8)
    pts = train + evals
    if pts:
        s = np.array([p[0] for p in pts], float)
        v = np.array([p[1] for p in pts], float)
        s0, s1 = s.min(), max(s.max(), s.min() + 1)
        v0, v1 = v.min(), max(v.max(), v.min() + 1e-6)
        to_xy = lambda st, val: (PAD + (st - s0) / (s1 - s0) * (W - 2 * PAD),
                                 H - PAD - (val - v0) / (v1 - v0) * (H - 2 * PAD))
        _line(img, (PAD, H - PAD), (W - PAD, H - PAD), GREY, 1)
        _line(img, (PAD, PAD), (PAD, H - PAD), GREY, 1)
        for series, color in ((train, BLUE), (evals, RED)):
            xy = [to_xy(*p) for p in series]
            for a, b in zip(xy, xy[1:]):
                _line(img, a, b, color)
            for x, y in xy if color == RED else []:
                _line(img, (x - 3, y), (x + 3, y), color, 4)
    Path(png_path).write_bytes(_png(img))
    return Path(png_path)
