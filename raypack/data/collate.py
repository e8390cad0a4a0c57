"""Packed rows -> the keyword arguments of a Hugging Face causal LM's forward.

Packed mode (`collate_packed(rows)`) concatenates every row into one [1, T] row. Examples are
found where `position_ids` restart (and at every row start), and their offsets go to the
attention as `cu_seq_lens_q/k`, computed here once per batch so that no layer has to:

    row 0: [a0 a1 a2 a3 | b0 b1 b2]   row 1: [c0 c1 c2 c3 c4]
                      |
                      v
    input_ids     a0  a1  a2  a3  b0  b1  b2  c0  c1  c2  c3  c4
    position_ids   0   1   2   3   0   1   2   0   1   2   3   4
    labels       -100 a1  a2  a3 -100 b1  b2 -100 c1  c2  c3  c4   (plus the rows' own -100s)
    cu_seq_lens  [0, 4, 7, 12]          max_length 5

Labels stay unshifted (the model shifts them); the -100 at each example's first position stops
the previous example's last token from predicting it. There is no attention_mask.

Padded mode (`padded=True`, for the pad and pad_sorted strategies) splits the same examples out
of the rows and right-pads them into a normal [B, Lmax] batch with an attention_mask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from raypack.data.formats import IGNORE_INDEX, row_labels


def example_starts(position_ids: np.ndarray) -> np.ndarray:
    """Offsets where a new example begins in one row: 0, and wherever a position does not follow
    its predecessor by one (a restart at 0, or a split piece resuming elsewhere)."""
    pos = np.asarray(position_ids, dtype=np.int64)
    if pos.size == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(pos[1:] != pos[:-1] + 1) + 1
    return np.concatenate([[0], breaks]).astype(np.int64)


def _examples(rows: Sequence[Mapping[str, Any]]):
    """Yield (input_ids, labels, position_ids) numpy slices, one per example, in row order."""
    for row in rows:
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        labels = np.asarray(row_labels(row), dtype=np.int64)
        pos = np.asarray(row["position_ids"], dtype=np.int64)
        if not (len(ids) == len(labels) == len(pos)):
            raise ValueError(
                f"packed row has input_ids/labels/position_ids of lengths {len(ids)}/{len(labels)}/{len(pos)}"
            )
        bounds = np.append(example_starts(pos), len(ids))
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            yield ids[lo:hi], labels[lo:hi], pos[lo:hi]


def collate_packed(
    rows: Sequence[Mapping[str, Any]], padded: bool = False, pad_token_id: int = 0
) -> dict[str, torch.Tensor | int]:
    """Model kwargs for a list of packed rows (keys other than input_ids, labels and
    position_ids are ignored).

    Packed:  input_ids, position_ids, labels [1, T] int64; cu_seq_lens_q, cu_seq_lens_k [N+1]
             int32 (one tensor); max_length_q, max_length_k int.
    Padded:  input_ids, attention_mask, position_ids, labels [B, Lmax] int64, one example a row.
    """
    examples = [ex for ex in _examples(rows) if len(ex[0])]
    if not examples:
        raise ValueError("collate_packed got no tokens")
    if padded:
        return _collate_padded(examples, pad_token_id)
    lengths = np.array([len(ids) for ids, _, _ in examples], dtype=np.int64)
    labels = np.concatenate([lab for _, lab, _ in examples])
    cu = np.concatenate([[0], np.cumsum(lengths)])
    labels[cu[:-1]] = IGNORE_INDEX
    cu_seqlens = torch.from_numpy(cu.astype(np.int32))
    max_len = int(lengths.max())
    return {
        "input_ids": torch.from_numpy(np.concatenate([ids for ids, _, _ in examples]))[None],
        "position_ids": torch.from_numpy(np.concatenate([pos for _, _, pos in examples]))[None],
        "labels": torch.from_numpy(labels)[None],
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


def _collate_padded(examples, pad_token_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _, _ in examples)
    shape = (len(examples), width)
    input_ids = np.full(shape, pad_token_id, dtype=np.int64)
    labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros(shape, dtype=np.int64)
    attention_mask = np.zeros(shape, dtype=np.int64)
    for i, (ids, lab, pos) in enumerate(examples):
        n = len(ids)
        input_ids[i, :n], labels[i, :n], position_ids[i, :n], attention_mask[i, :n] = ids, lab, pos, 1
        labels[i, 0] = IGNORE_INDEX  # as in packed mode; the shift never reads it anyway
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask),
        "position_ids": torch.from_numpy(position_ids),
        "labels": torch.from_numpy(labels),
    }


def shard_batch(batch: Mapping[str, Any], n: int, pad_token_id: int = 0) -> list[dict[str, Any]]:
    """One packed micro-batch (`collate_packed` and `loss.label_targets`' keys) cut into the `n`
    shards of a sequence-parallel group (raypack/model/ulysses.py), for n = 2:

        input_ids      a0 a1 a2 a3 a4 b0 b1 P      the row, padded to a multiple of n with one
        position_ids    0  1  2  3  4  0  1 0      example of pad tokens that carries no loss
        shard           0  0  0  0  1  1  1 1
        cu_seq_lens    [0, 5, 7, 8]                the whole row's, on every shard

    Each shard keeps its tokens' ids, positions and raw labels, and the loss targets of its own
    positions, found on the whole row before cutting: a shard's last token predicts the next
    shard's first, so no label is lost or counted twice at a cut."""
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    total = ids.shape[1]
    pad = -total % n
    cu, max_len = batch["cu_seq_lens_q"], batch["max_length_q"]
    if pad:
        ids = torch.cat([ids, ids.new_full((1, pad), pad_token_id)], 1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)[None]], 1)
        labels = torch.cat([labels, labels.new_full((1, pad), IGNORE_INDEX)], 1)
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
        max_len = max(max_len, pad)
    size = (total + pad) // n
    where = batch["loss_positions"] // size
    shards = []
    for k in range(n):
        mine = where == k
        shards.append({
            "input_ids": ids[:, k * size:(k + 1) * size], "position_ids": pos[:, k * size:(k + 1) * size],
            "labels": labels[:, k * size:(k + 1) * size], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": max_len, "max_length_k": max_len,
            "loss_positions": batch["loss_positions"][mine] - k * size, "loss_targets": batch["loss_targets"][mine],
        })  # fmt: skip
    return shards


def count_label_tokens(batch: Mapping[str, Any]) -> int:
    """Label tokens that contribute to the shifted loss (labels[..., 1:] != -100). Call it on the
    host batch, before moving it to the device, or it syncs."""
    return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())


def move_batch(batch: Mapping[str, Any], device: torch.device | str) -> dict[str, Any]:
    """Tensors to `device` (non-blocking); ints stay on the host. cu_seq_lens_k stays the same
    tensor as cu_seq_lens_q."""
    moved: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "cu_seq_lens_k" and value is batch.get("cu_seq_lens_q"):
            continue
        moved[key] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
    if "cu_seq_lens_k" in batch:
        same = batch["cu_seq_lens_k"] is batch.get("cu_seq_lens_q")
        moved["cu_seq_lens_k"] = moved["cu_seq_lens_q"] if same else batch["cu_seq_lens_k"].to(device)
    return moved
