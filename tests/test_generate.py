"""Sampling (laplace.sampling) and `python -m eval.generate` on checkpoints of the real trainer."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch
from conftest import CONFIGS, ROOT, randomize_
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from eval.generate import generate
from laplace.chat_format import render_for_completion
from laplace.checkpoint import load_model
from laplace.errors import ConfigError
from laplace.sampling import sample_texts, stream_tokens
from laplace.tokenizer import load_tokenizer
from train import run as train_run

TINY = ["experiment=gpt_pydoc", "model=gpt_d2_0L", "trainer.max_steps=2", "trainer.progress=false",
        "trainer.num_workers=0", "data.seq_len=32", "trainer.global_batch_size=8"]


def _train(tmp, name, *overrides) -> str:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, *overrides, f"paths.runs_dir={tmp / 'runs'}"])
    with open_dict(cfg):
        cfg.run_dir = str(tmp / name)
    train_run(cfg)
    return str(tmp / name / "ckpt" / "last.pt")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two 2-step runs of the real trainer: byte tokens (vocab 257, no room for the chat tokens)
    and the same with data.vocab_size=265 (the bytes tokenizer's 9 specials fit)."""
    tmp = tmp_path_factory.mktemp("gen")
    return {"plain": _train(tmp, "plain"), "chat": _train(tmp, "chat", "data.vocab_size=265")}


def _cli(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "eval.generate", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=120, check=False)


def _gen_cfg(*overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose("generate", overrides=list(overrides))


@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, None), (0.8, 5)])
def test_stream_tokens_matches_generate(ckpts, temperature, top_k):
    model = randomize_(load_model(ckpts["chat"]), seed=1)  # trained 2 steps: near-uniform; randomize
    prompt = [256] + list(b"The for statement")
    n = 24
    ref = model.generate(torch.tensor([prompt]), n, temperature=temperature, top_k=top_k,
                         generator=torch.Generator().manual_seed(7))[0, len(prompt):].tolist()
    got = list(stream_tokens(model, prompt, n, temperature, top_k, generator=torch.Generator().manual_seed(7)))
    assert got == ref and len(set(got)) > 1
    # A stop id ends the stream before it is yielded.
    stop = ref[5]
    first = ref.index(stop)
    assert list(stream_tokens(model, prompt, n, temperature, top_k, stop_ids=(stop,),
                              generator=torch.Generator().manual_seed(7))) == ref[:first]


def test_stream_tokens_checks_its_arguments_at_the_call(ckpts):
    model = load_model(ckpts["plain"])
    for kwargs, match in [({"temperature": -1.0}, "temperature=-1.0"), ({"top_k": -2}, "top_k=-2"),
                          ({"prompt_ids": [300]}, "prompt token id 300 .*vocab_size=257"),
                          ({"prompt_ids": []}, "prompt is empty"),
                          ({"max_new_tokens": 10**6}, "exceeds the model's longest sequence")]:
        args = {"prompt_ids": [256, 65], "max_new_tokens": 4} | kwargs
        with pytest.raises(ConfigError, match=match):
            stream_tokens(model, **args)  # raised before the first next()


def test_sample_texts_is_greedy_generate_decoded(ckpts):
    model, tok = randomize_(load_model(ckpts["plain"]), seed=2), load_tokenizer("bytes")
    texts = sample_texts(model, tok, ["The ", "Lists"], max_new_tokens=12)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    for prompt, text in zip(["The ", "Lists"], texts):
        ids = [256] + list(prompt.encode())
        out = model.generate(torch.tensor([ids]), 12, temperature=0)[0, len(ids):].tolist()
        if 256 in out:  # the completion ends where the model starts a new document
            out = out[:out.index(256)]
        assert text == tok.decode(out)


def test_stream_print_prints_multibyte_characters_whole():
    from eval.generate import _stream_print

    class Writes(io.StringIO):  # each write, as the terminal would get it
        def __init__(self):
            super().__init__()
            self.pieces = []

        def write(self, s):
            self.pieces.append(s)
            return super().write(s)

    tok = load_tokenizer("bytes")
    text = "naïve café → 日本 🙂!"
    out = Writes()
    assert _stream_print(text.encode("utf-8"), tok, out, "> ") == text
    assert out.getvalue() == f"> {text}\n"
    assert not any("\ufffd" in p for p in out.pieces)
    assert "🙂" in out.pieces  # printed once its 4th byte arrived


def test_cli_plain_prints_the_continuation(ckpts):
    proc = _cli(f"checkpoint={ckpts['plain']}", "prompt=The for", "max_new_tokens=8", "device=auto")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The for") and len(proc.stdout.rstrip("\n")) > len("The for")


def test_moved_tokenizer_names_the_key_generate_has(ckpts, tmp_path):
    """A run whose tokenizer file has moved: the error names eval.generate's own key
    (tokenizer=), which reads it from its new place, and refuses another tokenizer."""
    from laplace.data import DatasetNotFoundError
    from laplace.tokenizer import train_bpe

    ckpt = torch.load(ckpts["chat"], weights_only=True)  # plain data, as every checkpoint
    gone = tmp_path / "gone" / "tokenizer.json"
    ckpt["config"]["data"]["tokenizer"] = str(gone)
    moved = tmp_path / "moved.pt"
    torch.save(ckpt, moved)
    with pytest.raises(DatasetNotFoundError) as e:
        generate(_gen_cfg(f"checkpoint={moved}", "max_new_tokens=2", "device=cpu"), stdout=io.StringIO())
    msg = str(e.value)
    assert "\n" not in msg and str(gone) in msg and "tokenizer=<its new path>" in msg and "eval.generate" in msg
    # The run's tokenizer (bytes here) from elsewhere: generates.
    out = generate(_gen_cfg(f"checkpoint={moved}", "tokenizer=bytes", "prompt=Hi", "max_new_tokens=2",
                            "device=cpu"), stdout=io.StringIO())
    assert len(out) == 1
    other = train_bpe(["some text to merge, some more text to merge"] * 20, 270, tmp_path / "other.json")
    with pytest.raises(ConfigError, match=f"tokenizer={other.spec} is not the tokenizer"):
        generate(_gen_cfg(f"checkpoint={moved}", f"tokenizer={other.spec}", "device=cpu"), stdout=io.StringIO())


def test_chat_turns_accumulate(ckpts, monkeypatch):
    """In-process chat on stdin: blank lines are skipped, "quit" ends it, and each reply answers
    the whole conversation so far (checked against stream_tokens on a randomized model)."""
    cfg = _gen_cfg(f"checkpoint={ckpts['chat']}", "chat=true", "temperature=0", "max_new_tokens=6", "device=cpu")
    out = io.StringIO()
    replies = generate(cfg, stdin=io.StringIO("hello\n\nand then?\nquit\nnot read\n"), stdout=out)
    assert len(replies) == 2 and out.getvalue().count("User: ") == 4 and out.getvalue().count("Assistant: ") == 2

    import eval.generate as g

    model, tok = randomize_(load_model(ckpts["chat"]), seed=3), load_tokenizer("bytes")
    monkeypatch.setattr(g, "load_gpt", lambda path, device, tokenizer=None: (model, tok, {}))
    replies = generate(cfg, stdin=io.StringIO("hello\nand then?\n"), stdout=io.StringIO())  # ends at EOF
    end = tok.special_id("<|assistant_end|>")
    messages = []
    for turn, reply in zip(["hello", "and then?"], replies):
        messages.append({"role": "user", "content": turn})
        ids = render_for_completion(tok, {"messages": messages})
        assert reply == tok.decode(list(stream_tokens(model, ids, 6, stop_ids=(end, tok.bos_id))))
        messages.append({"role": "assistant", "content": reply})
    assert len(replies) == 2 and replies[0] != replies[1]


def test_cli_chat_with_a_prompt_and_errors(ckpts, tmp_path):
    proc = _cli(f"checkpoint={ckpts['chat']}", "chat=true", "prompt=Hi there", "max_new_tokens=8", "seed=1")
    assert proc.returncode == 0, proc.stderr
    # A model without the chat tokens in its vocabulary: one line, non-zero exit.
    proc = _cli(f"checkpoint={ckpts['plain']}", "chat=true", "prompt=Hi")
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("error: chat=true: the model's vocabulary (257 tokens) lacks the chat tokens")
    proc = _cli(f"checkpoint={tmp_path / 'missing.pt'}", "prompt=x")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: checkpoint={tmp_path / 'missing.pt'}: no such file or folder; pass "
                                   f"checkpoint=PATH to a GPT's laplace checkpoint "
                                   f"(runs/gpt/<data>/<run>/ckpt/last.pt) or exported folder")



class _ScriptedGPT(torch.nn.Module):
    """Greedy sampling from it writes `script`, one token per step, whatever it is fed; it
    records every token it is fed (so forced tool output can be seen going in)."""

    def __init__(self, script, vocab_size):
        super().__init__()
        self.wte = torch.nn.Embedding(1, 1)
        self.script, self.vocab_size, self.rope_len, self.fed = list(script), vocab_size, 10_000, []

    def new_kv_cache(self, batch_size, max_len):
        return None

    def forward(self, idx, kv_cache=None):
        self.fed += idx[0].tolist()
        step = len(self.fed) - self.prompt_len
        logits = torch.zeros(1, idx.shape[1], self.vocab_size)
        logits[0, -1, self.script[min(step, len(self.script) - 1)]] = 1.0
        return logits


def test_calculator_tool_is_arithmetic_only_and_forces_its_output():
    """nanochat's tool use: the value of <|python_start|> expr <|python_end|> is forced into the
    stream (and fed to the model); anything but arithmetic is refused."""
    from laplace.sampling import Calculator, calculate, stream_tokens
    from laplace.tokenizer import load_tokenizer

    assert calculate("12/4") == 3 and calculate("1,200 * 3") == 3600 and calculate("-(2+3)*4.5") == -22.5
    assert calculate("7 // 2 + 7 % 2") == 4 and calculate("1/3") == 0.333333
    for bad in ("2**100000", "__import__('os')", "open('x')", "1/0", "a + 1", "[1]*3", ""):
        assert calculate(bad) is None, bad

    tok = load_tokenizer("bytes")
    tools = Calculator(tok)
    end = tok.special_id("<|assistant_end|>")
    call = [tools.start, *tok.encode("2+3"), tools.end]
    output = [tools.out_start, *tok.encode("5"), tools.out_end]
    # The model writes the call, then (after the forced output) " ok" and the end of its turn.
    model = _ScriptedGPT(call + [0] * len(output) + tok.encode(" ok") + [end], tok.vocab_size)
    model.prompt_len = 1
    got = list(stream_tokens(model, [tok.bos_id], 50, stop_ids=(end,), tools=tools))
    assert got == call + output + tok.encode(" ok")
    assert model.fed[1:] == got  # the forced tokens went into the model like sampled ones
    # Without tools nothing is forced; a call that is not arithmetic gets no output either.
    model.fed = []
    assert list(stream_tokens(model, [tok.bos_id], 50, stop_ids=(end,))) == call + [0] * len(output) + tok.encode(" ok")
    assert tools.output_tokens(tok.encode("import os")) == []


def test_an_exported_folder_generates_as_its_checkpoint(ckpts, tmp_path):
    """`python -m laplace.export` folders: eval.generate samples from them as from the checkpoint, plain
    and chat, the tokenizer read from the folder (a trained BPE travels as tokenizer.json, so the run's
    own file may be gone)."""
    from laplace.checkpoint import save_checkpoint
    from train.config import model_node
    from laplace.export import export
    from laplace.tokenizer import train_bpe
    from laplace.zoo import create_model

    kw = ["prompt=The for", "max_new_tokens=12", "temperature=0.8", "device=cpu", "seed=3"]
    out = export(ckpts["chat"], tmp_path / "bytes_export")  # config.json names "bytes"
    for mode in ("chat=false", "chat=true"):
        want = generate(_gen_cfg(f"checkpoint={ckpts['chat']}", mode, *kw), stdout=io.StringIO())
        assert generate(_gen_cfg(f"checkpoint={out}", mode, *kw), stdout=io.StringIO()) == want and want[0]

    bpe_file = tmp_path / "data" / "tokenizer.json"
    tok = train_bpe(["The for statement iterates over the items of a list, in order."] * 50, 300, bpe_file)
    node = dict(model_node("gpt_d2_1L"), vocab_size=300, max_seq_len=32)
    ckpt = save_checkpoint(tmp_path / "bpe" / "ckpt" / "last.pt", model=randomize_(create_model(**node)),
                           data_identity={"tokenizer": tok.fingerprint()[:16]},
                           config={"model": node, "data": {"name": "pydoc_bpe", "tokenizer": str(bpe_file)}})
    out = export(ckpt, tmp_path / "bpe_export")
    want = generate(_gen_cfg(f"checkpoint={ckpt}", *kw), stdout=io.StringIO())
    bpe_file.unlink()
    assert generate(_gen_cfg(f"checkpoint={out}", *kw), stdout=io.StringIO()) == want and want[0]
    proc = _cli(f"checkpoint={out}", "prompt=The for", "max_new_tokens=8", "device=cpu")
    assert proc.returncode == 0 and proc.stdout.startswith("The for"), proc.stderr
    # an exported ViT is refused in one line
    vit = save_checkpoint(tmp_path / "vit" / "ckpt" / "last.pt", model=create_model("vitt_0L", depth=1, img_size=16),
                          config={"model": {"name": "vitt_0L", "depth": 1, "img_size": 16}})
    with pytest.raises(ConfigError, match=r"holds vitt_d1\w*_0L, not a GPT"):
        generate(_gen_cfg(f"checkpoint={export(vit, tmp_path / 'vit_export')}", "device=cpu"), stdout=io.StringIO())
