"""`python -m eval.generate`: text from a GPT checkpoint, printed token by token as it is sampled.

    python -m eval.generate checkpoint=runs/gpt/pydoc_text/gpt_d2_0L_s0/ckpt/last.pt prompt="The for"
    python -m eval.generate checkpoint=... prompt="Lists are" temperature=0 max_new_tokens=64   # greedy
    python -m eval.generate checkpoint=... chat=true prompt="What is a lambda?"                # one turn
    python -m eval.generate checkpoint=... chat=true                                           # a chat on stdin
    python -m eval.generate checkpoint=... 'prompt="Hi: there, you!"'    # punctuation: Hydra's quotes

Every default lives in configs/generate.yaml. The model is rebuilt from the checkpoint alone
(`laplace.checkpoint`) on `device` and its tokenizer from the checkpoint's config
(`laplace.tokenizer.tokenizer_from_config`: `data.tokenizer`, byte-level for runs without one);
`tokenizer=PATH` reads it from elsewhere when that file has moved (a run copied to another
machine), refused if it is not the tokenizer the run was trained with.

Plain mode continues `<|bos|> prompt` and prints the prompt, then the continuation as it comes.
Chat mode (`chat=true`, nanochat's chat_cli): the prompt is a user turn rendered by
`render_for_completion` (`... <|user_start|> prompt <|user_end|> <|assistant_start|>`) and the
reply ends at `<|assistant_end|>`; without a prompt, user turns are read from stdin, one per
line, and the conversation accumulates until EOF or "quit". Chat needs a model whose vocabulary
holds the chat special tokens (an SFT / mid-trained model, or any run with a bpe tokenizer or
`data.vocab_size=265` on bytes).

Sampling is `laplace.sampling.stream_tokens` (KV cache, same ids as `GPT.generate` for the same
seed); printing decodes everything generated so far and prints the new suffix, so multi-byte
characters appear whole. Bad input (missing checkpoint, a ViT checkpoint, chat on a model
without the chat tokens) exits with one `error: ...` line.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import torch
from omegaconf import DictConfig

from laplace import model_label
from laplace.chat_format import render_for_completion
from laplace.checkpoint import load_checkpoint, model_from_checkpoint
from laplace.data import DatasetNotFoundError
from laplace.dist import resolve_device
from laplace.cli import hydra_entry
from laplace.config import required
from laplace.errors import ConfigError
from laplace.gpt import GPT
from laplace.sampling import Calculator, IncrementalDecoder, stream_tokens
from laplace.tokenizer import load_tokenizer, tokenizer_from_config

QUIT = ("quit", "exit")


def _checkpoint(cfg) -> Path:
    value = required(cfg, "checkpoint", 'python -m eval.generate checkpoint=PATH prompt="..."')
    path = Path(str(value))
    if not path.is_file():
        raise ConfigError(f"checkpoint={value}: no such file; pass checkpoint=PATH to a GPT's laplace "
                          f"checkpoint, e.g. runs/gpt/<data>/<run>/ckpt/last.pt")
    return path


def load_generator_model(path, device: str = "auto", tokenizer: str | None = None):
    """(GPT in eval mode on its device, its tokenizer) from a checkpoint file; `tokenizer`:
    a path (or bytes | gpt2) instead of the one the checkpoint's config names."""
    ckpt = load_checkpoint(path)
    name = model_label(ckpt["config"]["model"])
    model = model_from_checkpoint(ckpt, resolve_device(device))
    if not isinstance(model, GPT):
        raise ConfigError(f"checkpoint={path} holds {name}, not a GPT: generation needs a language model")
    return model, _tokenizer(ckpt, path, tokenizer)


def _tokenizer(ckpt: dict, path, override: str | None):
    if override is None:
        try:
            return tokenizer_from_config(ckpt["config"])
        except DatasetNotFoundError:
            spec = ckpt["config"]["data"]["tokenizer"]
            raise DatasetNotFoundError(
                f"checkpoint={path} was trained with the tokenizer {spec} (data.tokenizer of its config), "
                f"which is not there: moved or deleted; pass tokenizer=<its new path> to "
                f"python -m eval.generate, or put the file back") from None
    tok = load_tokenizer(str(override))
    # Checkpoints since the data check (train/engine.py) know their tokenizer's fingerprint.
    trained = (ckpt.get("data_identity") or {}).get("tokenizer")
    if trained and tok.fingerprint()[:16] != trained:
        raise ConfigError(f"tokenizer={override} is not the tokenizer checkpoint={path} was trained with "
                          f"(fingerprint {tok.fingerprint()[:16]}, the run's {trained}); pass that run's "
                          f"tokenizer.json")
    return tok


def _stream_print(tokens, tok, out: TextIO) -> str:
    """Print a token stream as text as it arrives; return the whole text."""
    dec = IncrementalDecoder(tok)
    for t in tokens:
        piece = dec.push(t)
        if piece:
            out.write(piece)
            out.flush()
    out.write(dec.flush())
    out.flush()
    return dec.printed


def generate(cfg: DictConfig, stdin: TextIO | None = None, stdout: TextIO | None = None) -> list[str]:
    """Run the command: print the generated text(s) and return them (one per reply)."""
    stdin, out = stdin or sys.stdin, stdout or sys.stdout
    model, tok = load_generator_model(_checkpoint(cfg), str(cfg.device), cfg.tokenizer)
    device = model.wte.weight.device
    top_k = int(cfg.top_k) if cfg.top_k else None
    gen = torch.Generator(device=device).manual_seed(int(cfg.seed))

    def sample(ids, stop_ids=(), tools=None):
        return stream_tokens(model, ids, int(cfg.max_new_tokens), float(cfg.temperature), top_k,
                             stop_ids, gen, tools)

    prompt = None if cfg.prompt is None else str(cfg.prompt)
    if not cfg.chat:
        tokens = sample(tok.encode(prompt or "", prepend_bos=True))  # checked before printing
        out.write(prompt or "")
        text = _stream_print(tokens, tok, out)
        out.write("\n")
        return [text]

    end = tok.special_id("<|assistant_end|>")  # a tokenizer without chat tokens: its one-line error
    if end >= model.vocab_size:
        raise ConfigError(f"chat=true: the model's vocabulary ({model.vocab_size} tokens) lacks the chat "
                          f"tokens (<|assistant_end|> = {end}); it was not trained for chat, use chat=false")
    stops = (end, tok.bos_id)  # <|bos|>: a model that starts a new document has stopped answering
    tools = Calculator(tok)  # as nanochat's chat: the model's calculator calls are answered
    messages: list[dict] = []
    replies = []
    turns = [prompt] if prompt is not None else None
    interactive = turns is None
    if interactive:
        out.write("Chat: one user turn per line; \"quit\" or EOF (Ctrl-D) ends it.\n")
    while True:
        if interactive:
            out.write("\nUser: ")
            out.flush()
            line = stdin.readline()
            if not line:  # EOF
                out.write("\n")
                break
            text = line.strip()
            if text.lower() in QUIT:
                break
            if not text:
                continue
        else:
            if not turns:
                break
            text = turns.pop(0)
        messages.append({"role": "user", "content": text})
        tokens = sample(render_for_completion(tok, {"messages": messages}), stops, tools)
        out.write("Assistant: " if interactive else "")
        reply = _stream_print(tokens, tok, out)
        out.write("\n")
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


main = hydra_entry("generate")(generate)


if __name__ == "__main__":
    main()
