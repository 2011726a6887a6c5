"""Draw a Perfetto trace from `bench/step.py --perfetto` (or `neuron-inductor report --perfetto`) as a PNG
timeline: the kernel-launch track and one track per engine, slices coloured by kernel family.

    python bench/timeline_png.py step.json docs/step_timeline.png [--title TEXT]

Written with zlib and struct only (no plotting library is a dependency), text in a built-in 5x7 font.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from pathlib import Path

# 5x7 glyphs, one string of 7 rows of 5 bits per character.
_FONT_ROWS = {
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11110 10001 10001 10001 10001 10001 11110",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 01010 00100 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    " ": "00000 00000 00000 00000 00000 00000 00000", ".": "00000 00000 00000 00000 00000 01100 01100",
    ":": "00000 01100 01100 00000 01100 01100 00000", "/": "00001 00010 00010 00100 01000 01000 10000",
    "-": "00000 00000 00000 11111 00000 00000 00000", "%": "11000 11001 00010 00100 01000 10011 00011",
    "(": "00010 00100 01000 01000 01000 00100 00010", ")": "01000 00100 00010 00010 00010 00100 01000",
    "_": "00000 00000 00000 00000 00000 00000 11111", "=": "00000 00000 11111 00000 11111 00000 00000",
    "+": "00000 00100 00100 11111 00100 00100 00000", ",": "00000 00000 00000 00000 01100 00100 01000",
}
FONT = {c: [int(row, 2) for row in rows.split()] for c, rows in _FONT_ROWS.items()}
SCALE = 2  # font pixels per glyph bit
GLYPH_W, GLYPH_H = 6 * SCALE, 8 * SCALE

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207), (57, 59, 121), (173, 73, 74)]
WHITE, BLACK, GRID = (255, 255, 255), (30, 30, 30), (225, 225, 225)


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def rect(self, x0: float, y0: float, x1: float, y1: float, color) -> None:
        x0, x1 = max(0, int(x0)), min(self.width, max(int(x0) + 1, int(x1)))
        y0, y1 = max(0, int(y0)), min(self.height, int(y1))
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def text(self, x: int, y: int, text: str, color=BLACK) -> None:
        for i, char in enumerate(text.upper()):
            for r, bits in enumerate(FONT.get(char, FONT[" "])):
                for c in range(5):
                    if bits >> (4 - c) & 1:
                        gx, gy = x + i * GLYPH_W + c * SCALE, y + r * SCALE
                        self.rect(gx, gy, gx + SCALE, gy + SCALE, color)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def draw(document: dict, title: str, width: int = 1600) -> bytes:
    events = document["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    slices = [e for e in events if e["ph"] == "X"]
    launches = sorted((e for e in slices if e["cat"] == "launch"), key=lambda e: e["ts"])
    total = document["otherData"]["total_us"] or 1.0
    family_of = {e["ts"]: e["args"].get("family", e["name"]) for e in launches}
    shares: dict[str, float] = {}
    for e in launches:
        shares[family_of[e["ts"]]] = shares.get(family_of[e["ts"]], 0.0) + e["dur"]
    families = sorted(shares, key=lambda f: -shares[f])
    colors = {f: PALETTE[i % len(PALETTE)] for i, f in enumerate(families)}

    left, right, top, row_h, gap = 200, 30, 60, 36, 10
    legend_rows = (len(families) + 2) // 3
    height = top + len(tracks) * (row_h + gap) + 50 + legend_rows * 24 + 20
    canvas = Canvas(width, height)
    canvas.text(10, 15, title)
    plot_w = width - left - right
    x_of = lambda us: left + us / total * plot_w  # noqa: E731
    for i, tid in enumerate(sorted(tracks)):
        y = top + i * (row_h + gap)
        canvas.rect(left, y, width - right, y + row_h, GRID)
        canvas.text(10, y + (row_h - GLYPH_H) // 2 + 2, tracks[tid][:15])
        for e in slices:
            if e["tid"] != tid or e["cat"] == "instruction":
                continue
            owner = max((l["ts"] for l in launches if l["ts"] <= e["ts"] + 1e-9), default=e["ts"])
            color = colors.get(family_of.get(owner, ""), BLACK)
            canvas.rect(x_of(e["ts"]), y + 2, x_of(e["ts"] + e["dur"]), y + row_h - 2, color)
    axis_y = top + len(tracks) * (row_h + gap)
    canvas.rect(left, axis_y, width - right, axis_y + 2, BLACK)
    ticks = 10
    for t in range(ticks + 1):
        us = total * t / ticks
        x = int(x_of(us))
        canvas.rect(x, axis_y, x + 2, axis_y + 8, BLACK)
        label = f"{us / 1e3:.1f} MS" if total >= 1e3 else f"{us:.0f} US"
        canvas.text(max(0, min(width - len(label) * GLYPH_W, x - len(label) * GLYPH_W // 2)), axis_y + 12, label)
    legend_y = axis_y + 50
    column_w = (width - 20) // 3
    for i, family in enumerate(families):
        x, y = 10 + (i % 3) * column_w, legend_y + (i // 3) * 24
        canvas.rect(x, y, x + 16, y + 16, colors[family])
        canvas.text(x + 24, y, f"{family} {shares[family] / total:.1%}"[:column_w // GLYPH_W - 3])
    return canvas.png()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a Perfetto trace JSON (bench/step.py --perfetto)")
    parser.add_argument("png", help="the PNG to write")
    parser.add_argument("--title", default="", help="the title line (default: the trace's target and total)")
    args = parser.parse_args(argv)
    document = json.loads(Path(args.trace).read_text())
    other = document["otherData"]
    title = args.title or f"{other['target']} cost model: {other['total_us'] / 1e3:.2f} ms"
    Path(args.png).write_bytes(draw(document, title))
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
