"""A PNG that says it is 20000 x 20000 pixels in a few dozen bytes: its header, one tiny IDAT
chunk and IEND. PIL reads the size from the header (and, without raypack's limit, raises
DecompressionBombError there); decoding it would need 1.2 GB, so nothing may try."""

from __future__ import annotations

import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_png(width: int = 20000, height: int = 20000) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\x00" * 16))
            + _chunk(b"IEND", b""))
