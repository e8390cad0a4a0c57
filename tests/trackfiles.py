"""Read back what the trackers wrote: TensorBoard's event files and an offline W&B run file
(`run-<id>.wandb`), so tests compare the two.

TensorBoard: TFRecord framing (a little-endian u64 length, its crc, the bytes, their crc) around
`Event` protobufs, read with tensorboardX's own protos (the tensorboard package isn't a dependency).

wandb 0.31 writes the file from its Go core and ships no Python reader. The format is LevelDB's
log format behind a 7-byte header (":W&B", a 2-byte magic, a version byte): 32 KiB blocks of
records, each a 7-byte header (crc32c, little-endian length, type: 1 whole, 2 first, 3 middle,
4 last piece) and its bytes; a block's tail shorter than a header is zero padding. Each whole
record is a `wandb_internal_pb2.Record` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024


def records(path: str | Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # padding at a block's end
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeroed space after the last record
            break
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def history(path: str | Path) -> list[dict]:
    """Every `wandb.log` row, with its `_step`, as {key: value}."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def tensorboard_events(folder: str | Path):
    """(tag, step, value) of every scalar in `folder`'s event files, file by file in the order written."""
    for event in _events(folder):
        for value in event.summary.value:
            if value.WhichOneof("value") == "simple_value":  # images: tensorboard_images
                yield value.tag, event.step, value.simple_value


def _events(folder: str | Path):
    """Every event of `folder`'s TensorBoard files, file by file in the order written."""
    from tensorboardX.proto import event_pb2

    for file in sorted(Path(folder).glob("events.out.tfevents.*")):
        data, pos = file.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            yield event


def tensorboard_scalars(folder: str | Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} over every event file in `folder` (a step logged twice: its last value)."""
    scalars: dict[str, dict[int, float]] = {}
    for tag, step, value in tensorboard_events(folder):
        scalars.setdefault(tag, {})[step] = value
    return scalars


def config(path: str | Path) -> dict:
    """The run's config, as logged (nested sections as dicts)."""
    out = {}
    for r in records(path):
        if r.WhichOneof("record_type") in ("run", "config"):
            items = r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update
            out.update({item.key: json.loads(item.value_json) for item in items})
    return out


def tensorboard_images(folder: str | Path) -> dict[str, dict[int, tuple[int, int, bytes]]]:
    """{tag: {step: (height, width, PNG bytes)}} of every image in `folder`'s event files."""
    images: dict[str, dict[int, tuple[int, int, bytes]]] = {}
    for event in _events(folder):
        for value in event.summary.value:
            if value.HasField("image"):
                image = value.image
                images.setdefault(value.tag, {})[event.step] = (image.height, image.width, image.encoded_image_string)
    return images
