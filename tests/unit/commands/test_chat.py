"""`raypack chat` in a real pseudo-terminal: the streamed answers are the model's greedy answers to
the templated conversation, history and `/reset` included, and every way out exits cleanly.

The model is a tiny Llama built from a config, saved with raypack's bundled tokenizer (which has a
chat template). The expected answers come from a plain, non-streamed `generate` here.
"""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import termios
import time

import pytest
import torch

from paths import REPO

MAX_NEW = 12
DEADLINE_S = 120  # a guard against a hang; every read below ends on a marker, not on a timeout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random model and the bundled tokenizer, saved as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raypack.config import ASSETS
    from raypack.model.build import tiny_config

    folder = tmp_path_factory.mktemp("chat") / "model"
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def greedy(folder, messages: list[dict]) -> str:
    """The answer `generate` gives the conversation, greedy, not streamed: it stops at EOS or at
    the template's end of turn, `<|end|>`, as a model trained on raypack's chats learned to."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")],
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


class Terminal:
    """`raypack chat ...` with a pseudo-terminal as its controlling terminal (stdin, stdout, stderr)."""

    def __init__(self, *args: str):
        self.master, slave = os.openpty()
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}

        def take_terminal():  # after setsid: the pty becomes this session's terminal, so ^C is SIGINT
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen([sys.executable, "-m", "raypack.cli", "chat", *args], stdin=slave, stdout=slave,
                                     stderr=slave, env=env, start_new_session=True, preexec_fn=take_terminal)
        os.close(slave)
        self.deadline = time.monotonic() + DEADLINE_S
        self.screen = ""

    def read_until(self, marker: str) -> str:
        """Everything up to and including the next `marker` (after what earlier reads took)."""
        while marker not in self.screen:
            left = self.deadline - time.monotonic()
            ready, _, _ = select.select([self.master], [], [], max(left, 0))
            if not ready:
                self.kill()
                raise AssertionError(f"no {marker!r} within {DEADLINE_S} s; the screen:\n{self.screen}")
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: the process closed the terminal
                data = b""
            if not data:
                raise AssertionError(f"the chat ended before {marker!r}; the screen:\n{self.screen}")
            self.screen += data.decode(errors="replace").replace("\r\n", "\n")
        taken, self.screen = self.screen.split(marker, 1)
        return taken + marker

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait(self) -> tuple[int, str]:
        """Exit code, and what the process wrote after the last read."""
        rest = []
        while True:
            try:
                ready, _, _ = select.select([self.master], [], [], max(self.deadline - time.monotonic(), 0))
                data = os.read(self.master, 4096) if ready else b""
            except OSError:
                data = b""
            if not data:
                break
            rest.append(data.decode(errors="replace"))
        code = self.proc.wait(timeout=max(self.deadline - time.monotonic(), 1))
        os.close(self.master)
        return code, self.screen + "".join(rest)

    def kill(self) -> None:
        self.proc.kill()


def answer_of(taken: str) -> str:
    """The streamed answer in what was read up to the next prompt."""
    return taken.split("assistant> ", 1)[1].removesuffix("\nuser> ")


def test_a_conversation_streams_the_greedy_answers_keeps_its_history_and_resets(model_dir):
    term = Terminal(str(model_dir), "--temperature", "0", "--max-new-tokens", str(MAX_NEW))
    try:
        term.read_until("user> ")
        term.type("hello\n")
        first = answer_of(term.read_until("\nuser> "))
        expected = greedy(model_dir, [{"role": "user", "content": "hello"}])
        assert expected.strip(), "the tiny model answers nothing: the comparison would prove little"
        assert first == expected

        term.type("and then?\n")
        second = answer_of(term.read_until("\nuser> "))
        assert second == greedy(model_dir, [{"role": "user", "content": "hello"},
                                            {"role": "assistant", "content": first},
                                            {"role": "user", "content": "and then?"}])
        assert second != first, "the history changed nothing: the second answer can't show it was used"

        term.type("/reset\n")
        assert "[raypack] a new conversation" in term.read_until("user> ")
        term.type("and then?\n")
        assert answer_of(term.read_until("\nuser> ")) == greedy(model_dir, [{"role": "user", "content": "and then?"}])

        term.type("/exit\n")
        code, rest = term.wait()
    finally:
        term.kill()
    assert code == 0 and "Traceback" not in rest, rest


@pytest.mark.parametrize("key,code", [("\x04", 0), ("\x03", 130)], ids=["ctrl-d", "ctrl-c"])
def test_ctrl_d_and_ctrl_c_end_the_chat_without_a_traceback(model_dir, key, code):
    term = Terminal(str(model_dir))
    try:
        term.read_until("user> ")
        term.type(key)
        exit_code, rest = term.wait()
    finally:
        term.kill()
    assert exit_code == code and "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest


def test_prompt_answers_once_on_stdout(model_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "raypack.cli", "chat", str(model_dir.parent), "--prompt", "hello",
                          "--temperature", "0", "--max-new-tokens", str(MAX_NEW)],
                         capture_output=True, text=True, env=env, timeout=DEADLINE_S)
    assert out.returncode == 0, out.stderr[-2000:]
    # model_dir.parent: a folder holding model/, as an export does; status lines go to stderr
    assert out.stdout == greedy(model_dir, [{"role": "user", "content": "hello"}]) + "\n"
    assert f"[raypack] loading {model_dir}" in out.stderr


def test_a_folder_without_a_model_is_one_line(tmp_path, capsys):
    from raypack.cli import main

    assert main(["chat", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path}: no Hugging Face model there" in err



def test_an_empty_prompt_is_one_line_not_an_answer(model_dir, capsys, monkeypatch):
    from raypack.cli import main
    from raypack.train.chat import Chat

    monkeypatch.setattr(Chat, "load", lambda *a, **k: pytest.fail("the model was loaded for an empty prompt"))
    for prompt in ("", "  \n"):
        assert main(["chat", str(model_dir), "--prompt", prompt]) == 2
        assert capsys.readouterr().err == ("raypack: error: --prompt: the message is empty; give the text to answer, "
                                           "or leave --prompt out to chat\n")


def test_a_model_folder_chat_cannot_load_is_one_line_naming_it(model_dir, tmp_path, capsys):
    """Missing, without weights, with a config.json that isn't JSON, with a cut weights file:
    one line naming the path and what to do, no traceback."""
    import shutil

    from raypack.cli import main

    def broken(name, change):
        folder = tmp_path / name
        shutil.copytree(model_dir, folder)
        change(folder)
        return folder

    cases = {
        tmp_path / "typo": "no such folder",
        broken("no-weights", lambda f: (f / "model.safetensors").unlink()): "no model weights there (model.safetensors "
                                                                            "or pytorch_model.bin); export it again",
        broken("bad-config", lambda f: (f / "config.json").write_text("{oops")): "config.json: not valid JSON (",
        broken("cut", lambda f: (f / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes()[:99])):
            "can't load its model (",
    }
    for folder, said in cases.items():
        assert main(["chat", str(folder), "--prompt", "hi"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) <= 2 and err[-1].startswith(f"raypack: error: {folder}") and said in err[-1], err


IMAGE = REPO / "raypack/assets/vision_sample/images/000.png"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL and the bundled processor, saved as raypack saves a trained VLM."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from raypack.config import ASSETS
    from raypack.model.vision import save_vlm, tiny_vlm_config

    folder = tmp_path_factory.mktemp("vlm") / "model"
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "vlm_processor")
    image_processor = AutoImageProcessor.from_pretrained(ASSETS / "vlm_processor")
    torch.manual_seed(0)
    save_vlm(AutoModelForImageTextToText.from_config(tiny_vlm_config(image_processor, tokenizer)), folder,
             image_processor, tokenizer)
    return folder


def greedy_about_image(folder, text: str) -> str:
    """The greedy answer of `generate` to one message with the image before it, its prompt built
    here from the chat template and the image processor's grid (each <|image_pad|> becomes
    grid.prod() / merge_size² tokens, as Qwen2.5-VL's own processor expands it)."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tok, proc = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    pix = proc(images=[Image.open(IMAGE).convert("RGB")], return_tensors="pt")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    n = int(pix["image_grid_thw"][0].prod()) // proc.merge_size**2
    expanded = [t for i in ids for t in ([i] * n if i == pad else [i])]
    x = torch.tensor([expanded])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=pix["pixel_values"],
                             image_grid_thw=pix["image_grid_thw"], max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")],
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)


def test_image_prompt_answers_as_generate_does_with_the_image(vlm_dir, capsys):
    from raypack.cli import main

    assert main(["chat", str(vlm_dir), "--image", str(IMAGE), "--prompt", "What is it?", "--temperature", "0",
                 "--max-new-tokens", str(MAX_NEW)]) == 0
    assert capsys.readouterr().out == greedy_about_image(vlm_dir, "What is it?") + "\n"


def test_an_image_in_the_conversation_stays_until_reset(vlm_dir):
    from raypack.train.chat import Chat

    chat = Chat.load(vlm_dir, max_new_tokens=4, temperature=0)
    list(chat.send("What is it?", [str(IMAGE)]))
    inputs = chat.inputs([*chat.history, {"role": "user", "content": "And now?"}], chat.pictures)
    assert inputs["image_grid_thw"].shape[0] == 1  # the first message's image, still in the prompt
    pad = chat.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merge = chat.images.image_processor.merge_size**2
    assert (inputs["input_ids"] == pad).sum() == inputs["image_grid_thw"][0].prod() // merge
    chat.reset()
    assert chat.pictures == [] and chat.history == []


def test_a_bad_image_is_one_line_naming_it(vlm_dir, model_dir, tmp_path, capsys):
    from raypack.cli import main

    from hugeimage import huge_png

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    huge = tmp_path / "huge.png"
    huge.write_bytes(huge_png())  # 20000 x 20000, says its header
    cases = {
        (str(vlm_dir), str(tmp_path / "missing.png")): "missing.png' can't be read",
        (str(vlm_dir), str(broken)): "broken.png' is not a decodable image",
        (str(vlm_dir), str(huge)): "huge.png' is 20000x20000, 400,000,000 pixels, over --max-image-pixels (178,956,970)",
        (str(model_dir), str(IMAGE)): "--image: LlamaForCausalLM is a text-only model",
    }
    for (folder, image), said in cases.items():
        assert main(["chat", folder, "--image", image, "--prompt", "hi"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith("raypack: error: ") and said in err[-1], err


def test_an_empty_answer_says_so_on_stderr(capsys):
    """A model whose first token ends its turn (a briefly trained one) prints an empty answer:
    a status line says why, so it doesn't read like a hang."""
    from raypack.commands.chat import answer

    class Quiet:
        def send(self, text, images):
            yield from ("", " ")

    answer(Quiet(), "hi", prefix="")
    out = capsys.readouterr()
    assert out.out == " \n" and "the answer is empty: the model ended its turn without text" in out.err


# --- a peft adapter folder: what `raypack export` writes for a LoRA run -----------------------------


@pytest.fixture(scope="module")
def adapted(model_dir, tmp_path_factory):
    """model_dir's model with LoRA adapters (B drawn at random, so they change the answers), saved
    as peft saves them, with the tokenizer beside, naming model_dir as their base; and the merged
    model, saved as a plain folder: what the answers through the adapter must equal."""
    from exactness import random_lora_b
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raypack.config import PeftConfig
    from raypack.model.adapters import lora_config

    root = tmp_path_factory.mktemp("adapted")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora_config(PeftConfig(method="lora", r=4)))
    random_lora_b(model, scale=2.0)
    model.save_pretrained(root / "adapter")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(root / "adapter")
    model.merge_and_unload().save_pretrained(root / "merged")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(root / "merged")
    return root


def test_an_adapter_folder_answers_as_its_merged_model(adapted, model_dir, tmp_path, capsys):
    """On the base its adapter_config.json names; an export's layout (adapter/ beside base/, the
    base named by no one: a tiny model built from a config); and an export folder holding
    adapter/ alone (--adapter-only), which is found under it."""
    import json
    import shutil

    from raypack.cli import main

    expected = greedy(adapted / "merged", [{"role": "user", "content": "hello"}])
    assert expected != greedy(model_dir, [{"role": "user", "content": "hello"}]), "the adapter changes nothing"
    export = tmp_path / "export"
    shutil.copytree(adapted / "adapter", export / "adapter")
    shutil.copytree(model_dir, export / "base")
    settings = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert settings["base_model_name_or_path"] == str(model_dir)
    (export / "adapter" / "adapter_config.json").write_text(json.dumps({**settings, "base_model_name_or_path": ""}))
    for target, base in ((adapted / "adapter", model_dir), (export / "adapter", export / "base"), (export, export / "base")):
        args = ["chat", str(target), "--prompt", "hello", "--temperature", "0", "--max-new-tokens", str(MAX_NEW)]
        assert main(args) == 0
        out = capsys.readouterr()
        assert out.out == expected + "\n", target
        assert "loading" in out.err and "adapter" in out.err, out.err


def test_an_adapter_without_its_base_is_one_line_naming_the_file(adapted, tmp_path, capsys):
    import json
    import shutil

    from raypack.cli import main

    settings = json.loads((adapted / "adapter" / "adapter_config.json").read_text())
    cases = {"": "names no base model (base_model_name_or_path) and no base/ is beside it",
             str(tmp_path / "gone"): f"its base model {tmp_path / 'gone'} is not there any more"}
    for i, (base, said) in enumerate(cases.items()):
        folder = tmp_path / f"case{i}" / "adapter"
        shutil.copytree(adapted / "adapter", folder)
        (folder / "adapter_config.json").write_text(json.dumps({**settings, "base_model_name_or_path": base}))
        assert main(["chat", str(folder), "--prompt", "hi"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"raypack: error: {folder / 'adapter_config.json'}"), err
        assert said in err, err
