"""What the GPT trainer reads, one builder per `data.kind`: `build_text_data(cfg.data, ...)`.

    windows   byte windows of the built-in help text, in memory (data=pydoc_text)
    shards    token shards, memory-mapped and streamed (data=fineweb_edu, data=pydoc_bpe)
    chat      conversations: one padded conversation per row (SFT, data.packed=false) or
              several packed into rows of seq_len tokens (mid-training, data.packed=true)

Each builder returns a `TextData`: the training set (a map-style dataset or a feed), the
validation batches, the tokenizer, what throughput counts (unit) and the batch collate, so
the trainer asks for one object instead of switching on the kind.
"""
import functools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, open_dict

from laplace.errors import ConfigError
from laplace.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_config

from . import Data
from .shards import TokenStream, list_shards, open_shard
from .text import TokenWindows, build_pydoc_text


@dataclass
class TextData(Data):
    """One run's text data (laplace.data.Data), and:

    Args:
        tokenizer: the data's tokenizer (bits per byte, samples).
        token_budget: the step count comes from a token budget (pre-training), not from epochs.
        val_pass: makes this rank's batches of one validation pass where the data streams them
            itself (token shards); None: the trainer's loader makes them from `val`.
    """

    tokenizer: Tokenizer | None = None
    unit: str = "tok"
    token_budget: bool = False
    val_pass: Callable[[], Iterable] | None = None

    def val_batches(self, loader: Callable) -> Iterable | None:
        """This rank's batches of one validation pass; `loader` makes them from a map-style set."""
        if self.val_pass is not None:
            return self.val_pass()
        return loader(self.val) if self.val is not None else None


def resolve_tokenizer(d: DictConfig, init_from: str | None, check_vocab: bool = True) -> Tokenizer:
    """The data's tokenizer. Writes its absolute spec and vocabulary into `d` (the run's
    config), so that checkpoints name them and the model's vocab_size interpolation finds it.
    data.tokenizer=from_init: those of trainer.init_from's run (a fine-tuning run keeps its
    base model's tokenizer)."""
    if d.tokenizer == "from_init":
        from laplace.checkpoint import load_checkpoint

        if not init_from:
            raise ConfigError("data.tokenizer=from_init takes the tokenizer of trainer.init_from: set "
                              "trainer.init_from=PATH (a GPT checkpoint) or data.tokenizer=<file|bytes>")
        base = load_checkpoint(init_from).get("config") or {}
        with open_dict(d):
            d.tokenizer = tokenizer_from_config(base).spec
            d.vocab_size = (base.get("model") or {}).get("vocab_size")
    tok = load_tokenizer(d.tokenizer)
    # Written into the run's config: the checkpoint names its tokenizer, and the model node's
    # vocab_size (${data.vocab_size}) resolves to it.
    with open_dict(d):
        d.tokenizer = tok.spec  # absolute: the checkpoint's config finds it from anywhere
        if d.vocab_size is None:
            d.vocab_size = tok.vocab_size
    if check_vocab and d.vocab_size != tok.vocab_size:
        raise ConfigError(f"data.vocab_size={d.vocab_size} but the tokenizer {tok.spec} has "
                          f"{tok.vocab_size} ids; set data.vocab_size={tok.vocab_size} (or null)")
    return tok


def _windows(d, *, init_from, **_) -> TextData:
    if d.name != "pydoc_text":
        raise ConfigError(f"data.kind=windows serves data=pydoc_text only, got data={d.name!r}")
    # The windows' own vocabulary (256 bytes + <|bos|>) is the byte tokenizer's first 257 ids.
    tok = resolve_tokenizer(d, init_from, check_vocab=False)
    return TextData(build_pydoc_text(True, d.seq_len), build_pydoc_text(False, d.seq_len), tokenizer=tok,
                    units_per_sample=d.seq_len)


def _shards(d, *, init_from, micro_batch_size, rank, world_size, step_windows, **_) -> TextData:
    tok = resolve_tokenizer(d, init_from)
    # prepare's meta.json pins the tokenizer that wrote the ids: another one with as many ids
    # trains without an error on ids that mean other tokens (a fresh run as much as a resume).
    meta = Path(d.root, "meta.json")
    wrote = json.loads(meta.read_text()).get("settings", {}) if meta.is_file() else {}
    if wrote.get("tokenizer_fingerprint", tok.fingerprint()) != tok.fingerprint():
        raise ConfigError(f"data.tokenizer={tok.spec} is not the tokenizer that wrote the shards of data.root="
                          f"{d.root} (its meta.json's fingerprint differs): set data.tokenizer={d.root}/tokenizer.json")
    # A feed, not a dataset: it streams its own ranks' windows and resumes from its state_dict.
    train = TokenStream(list_shards(d.root, "train"), d.seq_len, micro_batch_size, rank=rank,
                        world_size=world_size, step_windows=step_windows, vocab_size=tok.vocab_size)
    # Validation streams once over <root>/val. Every rank makes the same number of batches
    # (collectives stay in step): counted from the shards' headers, capped at data.val_tokens.
    files = list_shards(d.root, "val")
    tokens = sum(len(open_shard(f)) for f in files)
    windows = (tokens - 1) // d.seq_len
    if d.val_tokens:
        windows = min(windows, d.val_tokens // d.seq_len)
    if windows < 1:  # said now, not at the first evaluation
        raise ConfigError(f"the validation shards {files[0].parent} hold {tokens} tokens, less than one window "
                          f"of data.seq_len={d.seq_len} (data.val_tokens={d.val_tokens}): prepare more val_docs")
    # A small validation shard still gives every rank one batch (of fewer rows). One pass, from
    # window 0; the last windows that do not fill a round are skipped (like drop_last).
    rows = max(1, min(micro_batch_size, windows // world_size))
    val = functools.partial(TokenStream, files, d.seq_len, rows, rank, world_size, loop=False, max_windows=windows,
                            vocab_size=tok.vocab_size)
    return TextData(train, None, tokenizer=tok, units_per_sample=d.seq_len, token_budget=True,
                    identity=train.identity(), val_pass=val)


def _chat(d, *, init_from, seed, **_) -> TextData:
    from .chat import PackedChatDataset, SFTDataset, build_mixture, sft_collate

    tok = resolve_tokenizer(d, init_from)
    # The mixture's order is drawn from the run's seed: the same conversations in the same order
    # on every rank and after a resume.
    train_convs = build_mixture(d.train, seed, key="data.train")
    val_convs = build_mixture(d.val, seed, key="data.val") if d.val else None
    if d.packed:  # mid-training: rows of seq_len tokens, several conversations each
        make = lambda convs: PackedChatDataset(convs, tok, d.seq_len, masked=d.masked)  # noqa: E731
        extra = dict(units_per_sample=d.seq_len)
    else:  # SFT: one conversation per row, padded to the longest of the batch
        if not d.masked:
            raise ConfigError("data.masked=false: SFT rows (data.packed=false) train on the assistant's "
                              "tokens only; set data.packed=true to train on every token of packed rows")
        make = lambda convs: SFTDataset(convs, tok, d.seq_len)  # noqa: E731
        # nanochat pads with <|assistant_end|>: any id works, padded targets are ignored.
        extra = dict(unit="conv", units_per_sample=1,
                     collate=functools.partial(sft_collate, pad_id=tok.special_id("<|assistant_end|>")))
    return TextData(make(train_convs), make(val_convs) if val_convs is not None else None, tokenizer=tok, **extra)


KINDS: dict[str, Callable[..., TextData]] = {"windows": _windows, "shards": _shards, "chat": _chat}


def build_text_data(d: DictConfig, *, seed: int, micro_batch_size: int, rank: int = 0,
                    world_size: int = 1, init_from: str | None = None, step_windows: int | None = None) -> TextData:
    """The TextData of `d` (the `data` config node) by its `kind`.

    Args:
        d: the data node; its tokenizer and vocab_size are resolved in place (see resolve_tokenizer).
        seed: the run's seed (the chat mixture's order).
        micro_batch_size, rank, world_size: this process's share (token shards stream per rank).
        init_from: trainer.init_from, for data.tokenizer=from_init.
        step_windows: rows of one optimizer step (the global batch): token shards' epochs end on it.
    The identity a resume checks: the shards' (token shards) and the tokenizer's fingerprint
    (data.tokenizer may move between machines, the tokenizer it names may not change).
    """
    kind = d.kind if "kind" in d else None
    if kind not in KINDS:
        raise ConfigError(f"data.kind={kind!r} (data={d.name}): choose {', '.join(KINDS)}")
    data = KINDS[kind](d, seed=seed, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size,
                       init_from=init_from, step_windows=step_windows)
    data.identity = {**(data.identity or {}), "tokenizer": data.tokenizer.fingerprint()[:16]}
    return data


def val_windows(d) -> TokenWindows:
    """The validation split of a GPT's data node (a dict or DictConfig) as a map-style set of (x, y)
    windows of data.seq_len tokens, for code that indexes them (the analyses): the validation
    shards of data=fineweb_edu / pydoc_bpe (without the trainer's data.val_tokens cap), or
    data=pydoc_text's held-out topics."""
    if d.get("kind") == "shards":
        # In memory: prepare's validation shard is val_docs documents (FineWeb-Edu's 10,000: ~10 M
        # tokens, 20 MB as uint16); the windows are TokenStream's, g*T .. g*T + T + 1.
        tokens = np.concatenate([open_shard(f) for f in list_shards(d["root"], "val")])
        ds = TokenWindows(torch.from_numpy(tokens), d["seq_len"])
        if len(ds) == 0:
            raise ConfigError(f"the validation shards of data.root={d['root']} hold {len(tokens)} tokens, less "
                              f"than one window of data.seq_len={d['seq_len']}: prepare more val_docs")
        return ds
    if d.get("name") == "pydoc_text":
        return build_pydoc_text(False, d["seq_len"])
    raise ConfigError(f"data={d.get('name')}: GPT checkpoints are analysed on token shards "
                      f"(data=fineweb_edu, data=pydoc_bpe: set data.root) or data=pydoc_text")
