"""What `raypack chat --prompt P --temperature 0` must print for a model: transformers' own greedy
`generate` (with the KV cache, as chat generates) on the prompt rendered by the folder's chat
template, stopped at EOS or at the bundled template's end of turn (`<|end|>`), decoded without
special tokens. Independent of raypack/train/chat.py; the model is loaded by the caller (a plain
folder, or peft's adapter on its base)."""

from __future__ import annotations

from pathlib import Path

import torch


def greedy(model, folder: str | Path, prompt: str = "hello", max_new: int = 8) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                    eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")],
                                    pad_token_id=tok.pad_token_id, use_cache=True)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
