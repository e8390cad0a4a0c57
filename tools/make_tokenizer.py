"""Train the tiny byte-level BPE tokenizer bundled in raypack/assets/tokenizer/.

    python tools/make_tokenizer.py            # rewrites raypack/assets/tokenizer/

Tests and the embedded default fine-tune need a real tokenizer with a chat template, and nothing
may come from a model hub, so we train one here on synthetic text. Deterministic: the same
corpus (seeded) and the same trainer settings give the same files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from raypack.data.synthetic import corpus_text  # noqa: E402

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# `{% generation %}` marks what the assistant writes (its content and the turn's end marker), so
# `return_assistant_tokens_mask` and raypack's own masking find the assistant tokens exactly.
CHAT_TEMPLATE = (
    r"{{ bos_token }}"
    r"{% for message in messages %}"
    r"{% if message['role'] == 'assistant' %}"
    r"{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\n' }}"
    r"{% else %}"
    r"{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    r"{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train(vocab_size: int, seed: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, *ROLE_MARKERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text(4000, seed=seed), trainer=trainer)
    # trim_offsets=False keeps character offsets exact, which assistant masking relies on.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_MARKERS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=16384,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "raypack" / "assets" / "tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=768)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok = train(args.vocab_size, args.seed)
    tok.save_pretrained(args.out)
    size = sum(p.stat().st_size for p in Path(args.out).iterdir())
    print(f"wrote {args.out}: vocab {len(tok)}, {size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
