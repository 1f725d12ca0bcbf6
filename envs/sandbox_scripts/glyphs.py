"""Render a short line of text (digits, + - * / % ( ) = . and space) as a PNG with a built-in 5x7 bitmap font.

Stdlib only: it runs in the sandbox (`python3 -c <this> OUT_PATH COLS CELL`, the text on stdin, the PNG
written to OUT_PATH) and in-process (`render_png`), with identical bytes. Each character fills one
CELL x CELL cell (CELL a multiple of 8; the 5x7 glyph is scaled by CELL // 8 and placed at (1, 0) of its
8x8 box), so with CELL equal to the model's patch size every character is exactly one patch. Lines wrap
after COLS characters. Black (0) ink on white (255), 8-bit RGB, no interlace, zlib level 9: deterministic.
"""

import struct
import sys
import zlib

FONT = {  # 7 rows of 5 bits, top to bottom
    "0": ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
    "1": ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
    "2": ("01110", "10001", "00001", "00010", "00100", "01000", "11111"),
    "3": ("11111", "00010", "00100", "00010", "00001", "10001", "01110"),
    "4": ("00010", "00110", "01010", "10010", "11111", "00010", "00010"),
    "5": ("11111", "10000", "11110", "00001", "00001", "10001", "01110"),
    "6": ("00110", "01000", "10000", "11110", "10001", "10001", "01110"),
    "7": ("11111", "00001", "00010", "00100", "01000", "01000", "01000"),
    "8": ("01110", "10001", "10001", "01110", "10001", "10001", "01110"),
    "9": ("01110", "10001", "10001", "01111", "00001", "00010", "01100"),
    "+": ("00000", "00100", "00100", "11111", "00100", "00100", "00000"),
    "-": ("00000", "00000", "00000", "11111", "00000", "00000", "00000"),
    "*": ("00000", "10101", "01110", "11111", "01110", "10101", "00000"),
    "/": ("00000", "00001", "00010", "00100", "01000", "10000", "00000"),
    "%": ("11000", "11001", "00010", "00100", "01000", "10011", "00011"),
    "(": ("00010", "00100", "01000", "01000", "01000", "00100", "00010"),
    ")": ("01000", "00100", "00010", "00010", "00010", "00100", "01000"),
    "=": ("00000", "00000", "11111", "00000", "11111", "00000", "00000"),
    ".": ("00000", "00000", "00000", "00000", "00000", "01100", "01100"),
    " ": ("00000",) * 7,
}
MAX_CHARS = 4096


def layout(text: str, cols: int, cell: int) -> tuple[int, int]:
    """(width, height) in pixels of `text` rendered with `cols` characters per line and `cell`-pixel cells."""
    if cols < 1 or cell < 8 or cell % 8:
        raise ValueError(f"need cols >= 1 and cell a positive multiple of 8, got cols={cols}, cell={cell}")
    n = max(1, len(text))
    return min(n, cols) * cell, -(-n // cols) * cell


def render_rows(text: str, cols: int, cell: int, blank: bool = False) -> list[bytes]:
    """Grey rows (one byte per pixel) of `text`; `blank`: the same size, all white."""
    bad = sorted({c for c in text if c not in FONT})
    if bad:
        raise ValueError(f"cannot render characters {bad}; the font has {''.join(sorted(FONT))!r}")
    if len(text) > MAX_CHARS:
        raise ValueError(f"text of {len(text)} characters is longer than {MAX_CHARS}")
    width, height = layout(text, cols, cell)
    rows = [bytearray(b"\xff" * width) for _ in range(height)]
    s = cell // 8
    for i, ch in enumerate("" if blank else text):
        x0, y0 = (i % cols) * cell, (i // cols) * cell
        for gy, bits in enumerate(FONT[ch]):
            for gx, bit in enumerate(bits):
                if bit == "1":
                    for dy in range(s):
                        y = y0 + gy * s + dy
                        x = x0 + (1 + gx) * s
                        rows[y][x : x + s] = b"\x00" * s
    return [bytes(r) for r in rows]


def encode_png(rows: list[bytes]) -> bytes:
    """Grey rows -> 8-bit RGB PNG bytes (filter 0 on every row, zlib level 9)."""
    height, width = len(rows), len(rows[0])

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + bytes(v for v in r for _ in range(3)) for r in rows)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))


def render_png(text: str, cols: int = 8, cell: int = 8, blank: bool = False) -> bytes:
    """PNG bytes of `text` (see the module docstring); `blank=True`: a white image of the same size."""
    return encode_png(render_rows(text, cols, cell, blank))


if __name__ == "__main__":
    out_path, cols_arg, cell_arg = sys.argv[1:4]
    data = render_png(sys.stdin.read(), int(cols_arg), int(cell_arg))
    with open(out_path, "wb") as f:
        f.write(data)
