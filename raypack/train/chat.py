"""Talk to a trained model: the chat template it trained with, its answer as the tokens come.

    chat = Chat.load("results/tiny_cpu/export/step_40/model", max_new_tokens=256, temperature=0.7)
    for piece in chat.send("What is packing?"):       # streamed; the answer joins the history
        print(piece, end="", flush=True)
    chat.reset()                                      # a new conversation
    chat.send("What is in it?", images=["cat.png"])   # a vision-language model's folder: the image first

A prompt is rendered as training rendered a conversation (the tokenizer's chat template, then
tokenized without added special tokens, raypack/data/encode.py), with the generation prompt after
the last user turn. A vision-language model's folder (a config with a vision tower, as
`raypack/model/vision.save_vlm` writes it: tokenizer, chat template and image processor) loads
with AutoModelForImageTextToText; its images go where the user's message puts them (before the
text), each expanded into its image tokens as training expanded them (raypack/data/images.py), and
stay in the conversation until `reset`.

Generation runs in a thread and `transformers.TextIteratorStreamer` hands the text over as it
decodes. It stops at EOS or at the template's end-of-turn token: a model trained
on multi-turn chats learned to close each turn with that token, and EOS only after the last one.
`temperature` 0 is greedy decoding. The model runs on CUDA when there is one, else on the CPU.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, GenerationConfig,
    StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer,
)

from raypack.config.sections import MAX_IMAGE_PIXELS
from raypack.data.image_layouts import processor_settings
from raypack.data.images import ImageTokenizer, decode_image, read_image_bytes
from raypack.errors import InputError
from raypack.model.vision import is_vlm


class ChatError(InputError):
    """A folder raypack can't chat with (the message names it)."""


ADAPTER_CONFIG = "adapter_config.json"
"""What marks a peft adapter folder (adapter/ of an export or a LoRA run's checkpoint)."""


def model_folder(path: str | Path) -> Path:
    """The Hugging Face model folder or peft adapter folder at `path`, or else its model/ (an
    export or a final checkpoint), or else its adapter/ (an export with --adapter-only)."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise ChatError(f"{path}: no such folder")
    for folder in (path, path / "model", path / "adapter"):
        if (folder / "config.json").exists() or (folder / ADAPTER_CONFIG).exists():
            return folder
    raise ChatError(f"{path}: no Hugging Face model there (no config.json), nor a peft adapter "
                    f"({ADAPTER_CONFIG}), nor a run folder")


def is_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).exists() and not (folder / "config.json").exists()


def adapter_base(adapter: Path) -> str:
    """What the peft adapter in `adapter` loads onto: the base/ an export writes beside it (a base
    built from a config, which no name reaches), else the base its adapter_config.json names (the
    run's model.name: a folder, or a hub name from_pretrained fetches). A ChatError naming the file
    for an adapter whose base can't be found."""
    beside = adapter.parent / "base"
    if (beside / "config.json").exists():
        return str(beside)
    try:
        named = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    except (ValueError, UnicodeDecodeError) as e:
        raise ChatError(f"{adapter / ADAPTER_CONFIG}: not valid JSON ({_first_line(e)}); {AGAIN}") from None
    if not named:
        raise ChatError(f"{adapter / ADAPTER_CONFIG} names no base model (base_model_name_or_path) and no base/ is "
                        "beside it: a base built from a config (a tiny- model) is saved by the run's final checkpoint "
                        "and by raypack export without --adapter-only, as base/ beside adapter/")
    if named.startswith(("/", ".", "~")) and not Path(named).expanduser().exists():
        raise ChatError(f"{adapter / ADAPTER_CONFIG}: its base model {named} is not there any more; put the folder "
                        "back, or chat with a merged model/")
    return named


AGAIN = "export it again (raypack export RUN --out FOLDER), or chat with the run folder"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The files transformers reads a model's weights from (one file, or an index of shards)."""


def check_model_files(folder: Path) -> None:
    """A ChatError naming the file, for a model folder whose config.json isn't JSON or that holds
    no weights: what transformers would report with a traceback, or a repo-id error."""
    try:
        json.loads((folder / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ChatError(f"{folder / 'config.json'}: not valid JSON ({_first_line(e)}); {AGAIN}") from None
    if not any((folder / name).exists() for name in WEIGHTS):
        raise ChatError(f"{folder}: no model weights there ({' or '.join(WEIGHTS[::2])}); {AGAIN}")


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def end_of_turn_ids(tokenizer) -> list[int]:
    """The special token the chat template closes an assistant turn with (<|end|>, <|im_end|>,
    <|eot_id|>, ...), found by rendering one: [] if it closes with plain text or none."""
    marker = "RAYPACK_END_OF_TURN_PROBE"
    try:
        conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that wants another conversation shape: EOS alone stops
        return []
    after = text.split(marker, 1)[1] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    return ids[:1] if ids and ids[0] in tokenizer.all_special_ids else []


class _Stop(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class Chat:
    """One conversation with one model (see the module doc)."""

    def __init__(self, model, tokenizer, max_new_tokens: int = 256, temperature: float = 0.7,
                 images: ImageTokenizer | None = None, max_image_pixels: int | None = MAX_IMAGE_PIXELS):
        if max_new_tokens < 1:
            raise ChatError(f"--max-new-tokens: expected a positive int, got {max_new_tokens}")
        if temperature < 0:
            raise ChatError(f"--temperature: expected a float >= 0 (0: greedy), got {temperature}")
        if max_image_pixels is not None and max_image_pixels < 1:
            raise ChatError(f"--max-image-pixels: expected a positive int, got {max_image_pixels}")
        self.model, self.tokenizer, self.images = model, tokenizer, images
        self.max_image_pixels = max_image_pixels
        """The most pixels an --image may have (read from its header, before it is decoded)."""
        self.history: list[dict] = []
        self.pictures: list = []
        """The conversation's images so far (decoded), in the order their messages place them."""
        stop = {tokenizer.eos_token_id, *end_of_turn_ids(tokenizer)} - {None}
        self.generation = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            **({"temperature": temperature} if temperature > 0 else {}),
            eos_token_id=sorted(stop),
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            use_cache=True,  # training saves the model with the cache off; generation wants it
        )

    @classmethod
    def load(cls, path: str | Path, device: str | None = None, **kwargs) -> Chat:
        """The model at `path` (model_folder), or a peft adapter on its base (adapter_base): the
        tokenizer and image processor from the folder itself (training saves them beside the
        adapter too), the weights from the base with the adapter on them."""
        folder = model_folder(path)
        adapter = folder if is_adapter(folder) else None
        weights = adapter_base(adapter) if adapter else folder
        if Path(weights).exists():
            check_model_files(Path(weights))
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as e:
            raise ChatError(f"{folder}: can't load its tokenizer ({_first_line(e)}); {AGAIN}") from e
        if not tokenizer.chat_template:
            raise ChatError(f"{folder}: its tokenizer has no chat template (raypack saves the one training used)")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        images, auto = None, AutoModelForCausalLM
        if is_vlm(AutoConfig.from_pretrained(weights)):
            try:
                images = ImageTokenizer(AutoImageProcessor.from_pretrained(folder), tokenizer, processor_settings(folder))
            except (OSError, ValueError) as e:
                raise ChatError(f"{folder}: a vision-language model without an image processor it can load "
                                f"({_first_line(e)}); {AGAIN}") from e
            auto = AutoModelForImageTextToText
        try:
            model = auto.from_pretrained(weights, dtype="auto")
            if adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, adapter)
            model = model.to(device).eval()
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # a truncated or foreign weights file
            raise ChatError(f"{adapter or folder}: can't load its model ({_first_line(e)}); {AGAIN}") from e
        return cls(model, tokenizer, images=images, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def prompt_ids(self, messages: list[dict[str, str]]) -> torch.Tensor:
        """The conversation as training tokenized one, then the generation prompt: [1, tokens]."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]

    def inputs(self, messages: list[dict], pictures: list) -> dict[str, torch.Tensor]:
        """What `generate` takes for the conversation: its tokens, and a VLM's pixels and grids."""
        if self.images is None:
            return {"input_ids": self.prompt_ids(messages)}
        return {k: torch.from_numpy(v) for k, v in self.images.prompt(messages, pictures).items()}

    def read_images(self, sources: Sequence[str]) -> list:
        """Decoded images from paths, URIs or base64 (a ChatError naming the one that fails)."""
        if sources and self.images is None:
            raise ChatError(f"--image: {type(self.model).__name__} is a text-only model; images need a "
                            "vision-language model's folder")
        try:
            return [decode_image(read_image_bytes(s, None, "--image"), s, "--image", self.max_image_pixels,
                                 "--max-image-pixels") for s in sources]
        except InputError as e:
            raise ChatError(str(e)) from None

    def send(self, text: str, images: Sequence[str] = ()) -> Iterator[str]:
        """The answer to `text` (with `images` before it, for a VLM), piece by piece as it is
        generated; once done it joins the history (an answer left unfinished, by an error or a
        closed iterator, does not)."""
        pictures = self.read_images(images)
        content = text if self.images is None else [*({"type": "image"} for _ in pictures), {"type": "text", "text": text}]
        messages = [*self.history, {"role": "user", "content": content}]
        inputs = {k: v.to(self.device) for k, v in self.inputs(messages, [*self.pictures, *pictures]).items()}
        ids = inputs.pop("input_ids")
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=0.1)
        stop, failed = threading.Event(), []

        def generate() -> None:
            try:
                self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs,
                                    generation_config=self.generation, streamer=streamer,
                                    stopping_criteria=StoppingCriteriaList([_Stop(stop)]))
            except BaseException as e:  # raised in the reader's thread below, not lost in this one
                failed.append(e)
                streamer.end()

        # daemon: an interrupted reader must never wait on a generation it no longer reads
        thread = threading.Thread(target=generate, name="raypack-generate", daemon=True)
        thread.start()
        pieces = []
        try:
            while True:
                try:
                    piece = next(streamer)
                except queue.Empty:
                    # Short waits, not one long one: a Ctrl-C that reached another thread (torch's)
                    # interrupts no wait of this one; between two waits the interpreter raises it.
                    continue
                except StopIteration:
                    break
                pieces.append(piece)
                yield piece
        finally:
            stop.set()
            thread.join(timeout=10)
        if failed:
            raise failed[0]
        self.history = [*messages, {"role": "assistant", "content": "".join(pieces)}]
        self.pictures += pictures

    def reset(self) -> None:
        self.history, self.pictures = [], []
