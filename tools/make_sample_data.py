"""Write the sample datasets bundled in raypack/assets/sample/, one per source format.

    python tools/make_sample_data.py      # rewrites raypack/assets/sample/

chat.jsonl is what the embedded default fine-tune trains on: a few hundred conversations of about
20 to 400 tokens. preference.jsonl is what the DPO quickstart (jobs/configs/dpo_quickstart.yaml)
trains on: conversational (prompt, chosen, rejected) pairs in TRL's format. tokenized.parquet is the completion sample run through the bundled tokenizer,
so it needs tools/make_tokenizer.py to have run first. Seeded, so the files come out the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from raypack.data.synthetic import make_examples, make_preference_examples  # noqa: E402


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "raypack" / "assets" / "sample"))
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # flan lengths clipped to 360 words keep every conversation under ~400 tokens.
    write_jsonl(out / "chat.jsonl", make_examples("chat", args.n, args.seed, kind="flan", max_length=360))
    write_jsonl(out / "instruction.jsonl", make_examples("instruction", args.n, args.seed + 1, kind="flan", max_length=360))
    completions = make_examples("completion", args.n, args.seed + 2, kind="flan", max_length=360)
    write_jsonl(out / "completion.jsonl", completions)
    write_jsonl(out / "preference.jsonl", make_preference_examples(args.n, args.seed + 3))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "raypack" / "assets" / "tokenizer")
    ids, labels = [], []
    for i, rec in enumerate(completions):
        prompt = tok(rec["prompt"])["input_ids"]
        answer = tok(rec["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids.append(prompt + answer)
        # Every other row carries no labels, to exercise the default (labels = input_ids).
        labels.append([-100] * len(prompt) + answer if i % 2 == 0 else None)
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "labels": pa.array(labels, pa.list_(pa.int32()))})
    pq.write_table(table, out / "tokenized.parquet", row_group_size=100)
    for p in sorted(out.iterdir()):
        print(f"{p}: {p.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
