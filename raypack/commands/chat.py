"""`raypack chat`: talk to a trained model in the terminal, its answers streamed as they come.

    raypack chat RUN                        # a run folder: its final model/, or its last checkpoint exported
    raypack chat RUN/export/step_200/model  # any Hugging Face model folder with a chat template
    raypack chat RUN/export/step_200/adapter   # a peft adapter folder, loaded onto its base
    raypack chat MODEL_DIR --prompt "Hi" --temperature 0     # answer once, for scripts
    raypack chat VLM_DIR --image cat.png --prompt "What is it?"   # a vision-language model

In the conversation, `/reset` starts a new one, `/image PATH` puts an image before the next
message (a vision-language model), and `/exit` (or Ctrl-D) ends it; Ctrl-C ends it too, with exit
code 130; `--image` goes with the first message. A peft adapter folder (LoRA's adapter/) loads onto
the base/ an export writes beside it, else the base its adapter_config.json names. A run that has not finished (no final model/, or one with merge: false)
has its last checkpoint exported into a temporary folder first (raypack/train/export.py), which is
removed on exit. No Ray: one process, on CUDA when there is one, else on the CPU. Status lines go
to stderr, so `--prompt` prints the answer alone on stdout.
"""

from __future__ import annotations

import argparse
import select
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from raypack import runs, storage
from raypack.train.chat import Chat, ChatError, adapter_base, is_adapter, model_folder
from raypack.train.stop import signal_of

USER, ASSISTANT = "user> ", "assistant> "


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging

    logging.disable_progress_bar()  # one bar per file loaded or saved
    if args.prompt is not None and not args.prompt.strip():
        raise ChatError("--prompt: the message is empty; give the text to answer, or leave --prompt out to chat")
    try:
        with model_of(args.target) as target:
            folder = model_folder(target)
            say(f"loading the peft adapter {folder} onto {adapter_base(folder)}" if is_adapter(folder) else
                f"loading {folder}")
            chat = Chat.load(folder, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             max_image_pixels=args.max_image_pixels)
            images = list(args.image or ())
            chat.read_images(images)  # a bad --image is one line now, not after the first message
            if args.prompt is not None:
                answer(chat, args.prompt, prefix="", images=images)
                return 0
            return converse(chat, folder, images)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (raypack/train/stop.py)
        print(file=sys.stderr)
        return 128 + signal_of(e)


def converse(chat: Chat, folder: str, images: list[str]) -> int:
    more = ", /image PATH adds an image to the next message" if chat.images is not None else ""
    say(f"chatting with {folder} on {chat.device.type}: /reset starts a new conversation{more}, /exit or Ctrl-D ends it")
    while True:
        line = read_line(USER)
        if not line:  # EOF: Ctrl-D
            print()
            return 0
        text = line.strip()
        if text == "/exit":
            if not sys.stdin.isatty():
                print()  # piped input is not echoed: end the prompt's line
            return 0
        if text == "/reset":
            chat.reset()
            images = []
            say("a new conversation")
        elif text.split()[0] == "/image" and chat.images is not None:
            path = text.removeprefix("/image").strip()
            try:
                chat.read_images([path])
            except ChatError as e:
                say(str(e))
                continue
            images.append(path)
            say(f"{path} goes with your next message")
        elif text.startswith("/"):
            say(f"unknown command {text.split()[0]}: /reset{', /image PATH' if chat.images is not None else ''} or /exit")
        elif text:
            answer(chat, text, prefix=ASSISTANT, images=images)
            images = []


def read_line(prompt: str) -> str:
    """input(), but one that Ctrl-C interrupts at once: the SIGINT may reach one of torch's threads
    instead of this one, and then no blocking read here returns; waiting in short selects lets the
    interpreter run the handler (KeyboardInterrupt) within 0.1 s. "" at EOF."""
    print(prompt, end="", flush=True)
    if sys.stdin.isatty():  # one line per read in a terminal: nothing waits in Python's buffer
        while not select.select([sys.stdin], [], [], 0.1)[0]:
            pass
    return sys.stdin.readline()


def answer(chat: Chat, text: str, prefix: str, images: list[str] = ()) -> None:
    print(prefix, end="", flush=True)
    said = False
    for piece in chat.send(text, images):
        print(piece, end="", flush=True)
        said = said or bool(piece.strip())
    print(flush=True)
    if not said:  # an empty line alone reads like a hang or a bug
        say("the answer is empty: the model ended its turn without text")


def say(line: str) -> None:
    print(f"[raypack] {line}", file=sys.stderr, flush=True)


@contextmanager
def model_of(target: str) -> Iterator[str]:
    """The model folder to load: `target` itself, or for a run folder its final model/, else its
    last checkpoint exported (merged, for LoRA) into a temporary folder."""
    root = storage.absolute(target)
    if not storage.exists(f"{root}/{runs.SAVED_CONFIG}"):
        yield target
        return
    result = runs.read_result(root)
    final = f"{result['checkpoint']}/model" if result and result.get("checkpoint") else None
    # a finished run that was resumed for more steps has checkpoints past its final model
    last = max((c["metrics"].get("step", 0) for c in runs.reported_checkpoints(root)), default=0)
    if final and last <= result.get("step", 0) and not storage.is_uri(final) and storage.exists(f"{final}/config.json"):
        yield final
        return
    from raypack.train.export import export

    with tempfile.TemporaryDirectory(prefix="raypack-chat-") as tmp:
        say(f"run {root} has no final model here: exporting its last checkpoint")
        done = export(root, out=tmp, merge=True, log=lambda line: print(line, file=sys.stderr, flush=True))
        yield f"{done.out}/model"
