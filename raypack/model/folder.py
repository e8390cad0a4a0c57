"""A local model folder's weights, checked from their files' headers before Ray starts.

    check_folder("path/to/model", config, torch.float16)   # a CheckpointError naming the file, or None

transformers finds a folder's broken weights only once every worker reads them, after Ray has
started and the data is packed: a folder with no weights, an index naming a shard that isn't
there, a shard cut short by a failed copy, tensors of another config's shapes. Each is one line
here, naming the file, read from the safetensors headers (a few KB a shard, never the weights).

A dtype the folder can't give: `model.dtype: float16` on weights stored in a wider range
(bfloat16, float32). float16 holds magnitudes up to 65504 where bfloat16 holds 3e38: a larger
weight would load as inf, and only reading every weight could say none is, so the cast is
refused rather than trusted (bfloat16 and float32 hold every float16 and bfloat16 value's range).
Quantized folders (a `quantization_config`) store what their method decides and are left to it.

Hub names are left to transformers: their weights are not on this machine yet.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from raypack.errors import InputError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHTS = (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX)
"""The files transformers reads a model's weights from, in its order of preference (one file, or an index of shards)."""

MAX_HEADER = 100 << 20
"""safetensors' own bound on a header's size: a larger length prefix is not a safetensors file."""

WIDER_THAN_FLOAT16 = {"BF16": "bfloat16", "F32": "float32", "F64": "float64"}


class CheckpointError(InputError):
    """A model folder whose weights transformers can't load as this config's, or in this dtype."""


def check_folder(name: str, config, dtype: torch.dtype, meta_model=None) -> None:
    """Refuse `name`'s weights, if it is a local folder, where they are missing, cut short, not
    `config`'s shapes (against `meta_model`, the config's model on the meta device, where given),
    or stored in a range `dtype` can't hold."""
    folder = Path(name)
    if not folder.is_dir():
        return
    headers = _headers(folder)
    if headers is None:  # pickled weights: no header to read without unpickling them
        return
    if meta_model is not None:
        _check_shapes(headers, meta_model)
    if dtype == torch.float16 and getattr(config, "quantization_config", None) is None:
        _check_float16(headers)


def _headers(folder: Path) -> dict[Path, dict] | None:
    """Each safetensors shard's header by its path; None for a folder of pickled (.bin) weights."""
    present = [name for name in WEIGHTS if (folder / name).exists()]
    if not present:
        raise CheckpointError(f"model.name {str(folder)!r}: no weights in the folder (none of {', '.join(WEIGHTS)})")
    first = folder / present[0]
    if first.name in (SAFETENSORS_INDEX, BIN_INDEX):
        weight_map = _weight_map(first)
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise CheckpointError(f"{first}: names the shard {shard}, which is not in the folder")
        if first.name == BIN_INDEX:
            return None
        headers = {folder / shard: _header(folder / shard) for shard in sorted(set(weight_map.values()))}
        for tensor, shard in weight_map.items():
            if tensor not in headers[folder / shard]:
                raise CheckpointError(f"{first}: puts {tensor} in {shard}, which doesn't hold it")
        return headers
    return None if first.name == BIN else {first: _header(first)}


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a weights index (JSON with a weight_map): {type(e).__name__}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: its weight_map is not tensor names to shard files")
    return weight_map


def _header(path: Path) -> dict[str, dict]:
    """The tensors of a safetensors file (name -> dtype, shape, data_offsets), its size checked."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if length is None or length > min(MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: not a safetensors file (its header is missing or cut short)")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + length + end > size:  # a copy or download that stopped early
        raise CheckpointError(f"{path}: cut short ({size} bytes where its header needs {8 + length + end})")
    return header


def _check_shapes(headers: dict[Path, dict], meta_model) -> None:
    """Tensors the checkpoint and the model both name must have one shape. Names transformers
    renames as it loads (fused MoE experts, a VLM's older layout) are left to its conversion."""
    shapes = {name: list(t.shape) for name, t in meta_model.state_dict().items()}
    wrong = [(path, name, t["shape"], shapes[name]) for path, header in headers.items()
             for name, t in header.items() if name in shapes and list(t["shape"]) != shapes[name]]  # fmt: skip
    if wrong:
        path, name, got, want = wrong[0]
        more = f" (and {len(wrong) - 1} more tensors)" if len(wrong) > 1 else ""
        raise CheckpointError(f"{path}: {name} is {got} where config.json's model has {want}{more}: "
                              "these weights are not this config's")  # fmt: skip


def _check_float16(headers: dict[Path, dict]) -> None:
    for path, header in headers.items():
        wider = {WIDER_THAN_FLOAT16[t["dtype"]] for t in header.values() if t["dtype"] in WIDER_THAN_FLOAT16}
        if wider:
            raise CheckpointError(
                f"model.dtype float16: {path} stores its weights in {', '.join(sorted(wider))}, whose range float16 "
                "can't hold (a weight above 65504 would load as inf); use model.dtype bfloat16 or float32"
            )
