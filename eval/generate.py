"""`python -m eval.generate`: text from a GPT, printed token by token as it is sampled.

    python -m eval.generate checkpoint=runs/gpt/pydoc_text/gpt_d2_0L_s0/ckpt/last.pt prompt="The for"
    python -m eval.generate checkpoint=exports/gpt_d2_0L prompt="The for"      # an exported folder
    python -m eval.generate checkpoint=... prompt="Lists are" temperature=0 max_new_tokens=64   # greedy
    python -m eval.generate checkpoint=... chat=true prompt="What is a lambda?"                # one turn
    python -m eval.generate checkpoint=... chat=true                                           # a chat on stdin
    python -m eval.generate checkpoint=... 'prompt="Hi: there, you!"'    # punctuation: Hydra's quotes

Defaults: configs/generate.yaml. `load_gpt` (also the lm-eval adapter's) rebuilds the model and its
tokenizer from a checkpoint or an exported folder alone.
"""
import codecs
import sys
from pathlib import Path
from typing import TextIO

import torch
from omegaconf import DictConfig

from laplace import load_model, model_label
from laplace.chat_format import render_for_completion
from laplace.checkpoint import EXPORT_TOKENIZER, model_source
from train.cli import hydra_entry
from train.config import required
from laplace.data import DatasetNotFoundError
from train.dist import resolve_device
from laplace.errors import ConfigError
from laplace.sampling import Calculator, stream_tokens
from laplace.tokenizer import load_tokenizer

def gpt_source(path) -> dict:
    """What the GPT at `path` (a laplace checkpoint or a folder of `python -m laplace.export`) is,
    read without building it: {path, node, dataset, step, git_rev, seq_len, tokenizer, fingerprint}."""
    path = Path(str(path)).expanduser()
    if not path.exists():
        raise ConfigError(f"checkpoint={path}: no such file or folder; pass checkpoint=PATH to a GPT's laplace "
                          f"checkpoint (runs/gpt/<data>/<run>/ckpt/last.pt) or exported folder")
    src = model_source(path)  # the one loader's description, read without building the model
    # An export's config.json holds the model node, the tokenizer and the source; a checkpoint its config.
    ckpt, export = src["ckpt"], src.get("export") or {}
    data = ckpt["config"].get("data") or {}
    spec = export.get("tokenizer") or data.get("tokenizer") or "bytes"  # runs before data.tokenizer were byte-level
    info = dict(node=src["node"], dataset=data.get("name") or (export.get("source") or {}).get("data"),
                step=(ckpt.get("loop") or {}).get("step"), git_rev=ckpt.get("git_rev"), seq_len=data.get("seq_len"),
                # the tokenizer the run trained with (train/gpt.py): its file may have changed since
                fingerprint=(ckpt.get("data_identity") or {}).get("tokenizer"),
                # a trained BPE travels as tokenizer.json in an export's folder; bytes / gpt2 are built in
                tokenizer=str(src["path"] / spec) if export and spec == EXPORT_TOKENIZER else spec)
    if not str(info["node"].get("name", "")).startswith("gpt"):
        raise ConfigError(f"checkpoint={path} holds {model_label(info['node'])}, not a GPT: generation and "
                          f"lm-eval need a language model")
    return {"path": path, "source": src, **info}


def load_gpt(path, device="cpu", tokenizer: str | None = None):
    """(GPT in eval mode on `device`, its tokenizer, gpt_source's info) of a checkpoint or export.
    `tokenizer` (a path, bytes or gpt2) stands in for the run's where that file has moved; one that
    is not the tokenizer the run trained with is refused."""
    info = gpt_source(path)
    # The tokenizer before the weights: a missing one fails before they are read.
    if tokenizer is None:
        try:
            tok = load_tokenizer(info["tokenizer"])
        except DatasetNotFoundError:
            raise DatasetNotFoundError(
                f"checkpoint={info['path']} was trained with the tokenizer {info['tokenizer']} (data.tokenizer of "
                f"its config), which is not there: moved or deleted; pass tokenizer=<its new path> to python -m "
                f"eval.generate (or lm-eval's model_args), or put the file back") from None
    else:
        tok = load_tokenizer(str(tokenizer))
        if info["fingerprint"] and tok.fingerprint()[:16] != info["fingerprint"]:
            raise ConfigError(f"tokenizer={tokenizer} is not the tokenizer checkpoint={info['path']} was trained "
                              f"with (fingerprint {tok.fingerprint()[:16]}, the run's {info['fingerprint']}); pass "
                              f"that run's tokenizer.json")
    return load_model(info["source"], device), tok, info


def _stream_print(tokens, tok, out: TextIO, before: str = "") -> str:
    """Print `before`, then a token stream as text as it arrives, then a newline; return the text.
    codecs' incremental UTF-8 decoding holds back a character until its last byte has come, so é,
    emoji and CJK characters (or a BPE token cut inside one) print whole; one that never completes
    prints as U+FFFD at the end."""
    print(before, end="", file=out)
    pieces = []
    for piece in codecs.iterdecode((tok.enc.decode_single_token_bytes(int(t)) for t in tokens), "utf-8", "replace"):
        pieces.append(piece)  # iterdecode yields nothing until a character is whole
        print(piece, end="", file=out, flush=True)
    print(file=out, flush=True)
    return "".join(pieces)


def _turns(stdin: TextIO, out: TextIO):
    """The user turns of an interactive chat: lines of stdin until EOF or "quit" (blank ones skipped)."""
    print("Chat: one user turn per line; \"quit\" or EOF (Ctrl-D) ends it.\n\nUser: ", end="", file=out, flush=True)
    for line in iter(stdin.readline, ""):  # "" at EOF
        if line.strip().lower() in ("quit", "exit"):
            return
        if line.strip():
            yield line.strip()  # the reply is printed before the next prompt
        print("\nUser: ", end="", file=out, flush=True)
    out.write("\n")  # EOF (Ctrl-D): end the prompt's line


def generate(cfg: DictConfig, stdin: TextIO | None = None, stdout: TextIO | None = None) -> list[str]:
    """Run the command: print the generated text(s) and return them (one per reply)."""
    stdin, out = stdin or sys.stdin, stdout or sys.stdout
    checkpoint = required(cfg, "checkpoint", 'python -m eval.generate checkpoint=PATH prompt="..."')
    model, tok, _ = load_gpt(checkpoint, resolve_device(str(cfg.device)), cfg.tokenizer)
    gen = torch.Generator(device=model.wte.weight.device).manual_seed(int(cfg.seed))

    def sample(ids, stop_ids=(), tools=None):
        # laplace.sampling: the KV-cache loop, the same ids as GPT.generate for the same seed
        return stream_tokens(model, ids, int(cfg.max_new_tokens), float(cfg.temperature), int(cfg.top_k or 0) or None,
                             stop_ids, gen, tools)

    prompt = None if cfg.prompt is None else str(cfg.prompt)
    if not cfg.chat:  # stream_tokens checks its arguments at the call, before anything is printed
        return [_stream_print(sample(tok.encode(prompt or "", prepend_bos=True)), tok, out, prompt or "")]

    end = tok.special_id("<|assistant_end|>")  # a tokenizer without chat tokens: its one-line error
    if end >= model.vocab_size:
        raise ConfigError(f"chat=true: the model's vocabulary ({model.vocab_size} tokens) lacks the chat "
                          f"tokens (<|assistant_end|> = {end}); it was not trained for chat, use chat=false")
    stops = (end, tok.bos_id)  # <|bos|>: a model that starts a new document has stopped answering
    tools = Calculator(tok)  # as nanochat's chat: the model's calculator calls are answered
    messages, replies = [], []
    for text in [prompt] if prompt is not None else _turns(stdin, out):
        # the whole conversation so far, rendered as SFT saw it, ending with <|assistant_start|>
        messages.append({"role": "user", "content": text})
        tokens = sample(render_for_completion(tok, {"messages": messages}), stops, tools)
        replies.append(_stream_print(tokens, tok, out, "Assistant: " if prompt is None else ""))
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


main = hydra_entry("generate")(generate)


if __name__ == "__main__":
    main()
