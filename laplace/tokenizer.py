"""Tokenizers of the GPT pipeline: nanochat's BPE, raw UTF-8 bytes, and GPT-2's BPE, behind one API.

    tok = train_bpe(texts, vocab_size=65536, path="data/fineweb/tokenizer.json")   # or
    tok = load_tokenizer("data/fineweb/tokenizer.json")     # | "bytes" | "gpt2"
    ids = tok.encode("Hello", prepend_bos=True)              # ordinary text, never specials
    tok.decode(ids), tok.token_bytes(), tok.special_id("<|assistant_start|>")

Every kind is a `tiktoken.Encoding` (mergeable ranks + special tokens appended after them), so
encoding runs in Rust and `encode_batch` is parallel over documents (tiktoken releases the GIL):

* "bpe": trained as nanochat trains it, with `rustbpe` (a GPT-4-style byte-level BPE trainer)
  on the split regex below; the vocabulary is the 256 byte tokens, vocab_size - 265 merges, then
  nanochat's 9 special tokens. Saved as one JSON file (format tag and version, split pattern,
  the ranks as base64 in rank order, the special tokens) that `load_tokenizer` reads back.
* "bytes": ids 0..255 are the UTF-8 bytes, then the same 9 specials at 256..264: <|bos|> = 256 as
  in the built-in byte-level text (laplace.data.text), so its shards and models stay valid.
* "gpt2": tiktoken's own GPT-2 encoding (<|endoftext|> = 50256 is the BOS; no chat specials). Its
  BPE files come from tiktoken's cache (TIKTOKEN_CACHE_DIR), downloaded once where there is a
  network.

`spec` is the string that rebuilds a tokenizer ("bytes", "gpt2" or the absolute path of its
saved file); datasets record it in meta.json and checkpoints in their config, and
`load_tokenizer(spec)` is cached so evaluation loops may call it freely.

`token_bytes()` is nanochat's table for bits per byte: the UTF-8 length of every token (0 for
specials), so bpb = sum of the targets' losses in nats / (ln 2 * sum of their token_bytes).
"""
import base64
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken
import torch

from laplace.errors import ConfigError, DatasetNotFoundError
from laplace.io import atomic_write

# nanochat's special tokens: documents start with <|bos|>; the rest delimit chat turns and tool
# calls for supervised fine-tuning. They follow the ordinary tokens, in this order.
SPECIAL_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                  "<|assistant_end|>", "<|python_start|>", "<|python_end|>", "<|output_start|>",
                  "<|output_end|>")

# GPT-4's (cl100k) split regex as nanochat uses it: numbers are split into groups of at most 2
# digits (\p{N}{1,2}) instead of GPT-4's 3, which spends fewer merges on numbers in a small vocab.
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}|"""
                 r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")

FORMAT = "laplace.tokenizer"  # the tag of a saved file, so a foreign JSON is refused clearly
FORMAT_VERSION = 1
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # a BPE vocabulary must exceed this (>= 1 merge)


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Tokenizer:
    """A `tiktoken.Encoding` with the pipeline's conventions (see the module docstring).

    Attributes:
        kind: "bpe", "bytes" or "gpt2".
        vocab_size: number of ids, specials included.
        bos_id: the id that starts every document.
        spec: what `load_tokenizer` takes to rebuild it; None for a trained, unsaved BPE.
        enc: the underlying tiktoken.Encoding.
    """

    def __init__(self, kind: str, enc: tiktoken.Encoding, bos: str, spec: str | None):
        self.kind, self.enc, self.spec = kind, enc, spec
        self.vocab_size = enc.n_vocab
        self.bos_id = enc._special_tokens[bos]
        self._token_bytes: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, spec={self.spec!r})"

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self.enc._special_tokens)

    def special_id(self, name: str) -> int:
        """The id of a special token, e.g. "<|user_start|>". "<|bos|>" always names `bos_id`
        (GPT-2's <|endoftext|>), so code that only needs the document start works with any kind."""
        if name == "<|bos|>":
            return self.bos_id
        specials = self.enc._special_tokens
        if name in specials:
            return specials[name]
        if name in SPECIAL_TOKENS:
            raise ConfigError(f"tokenizer={self.spec} has no special token {name}: chat fine-tuning "
                              f"needs nanochat's specials, use a bpe tokenizer (or bytes)")
        raise ConfigError(f"unknown special token {name!r}; tokenizer={self.spec} has "
                          f"{', '.join(specials)}")

    def encode(self, text: str, prepend_bos: bool = False) -> list[int]:
        """Ids of ordinary text: a special token's string inside `text` is encoded as plain text."""
        # Specials are never parsed out of text: a document (or a user's chat turn) that contains
        # "<|assistant_end|>" cannot end a turn; chat_format inserts specials by id.
        ids = self.enc.encode_ordinary(text)
        return [self.bos_id, *ids] if prepend_bos else ids

    def encode_batch(self, texts: list[str], prepend_bos: bool = False,
                     num_threads: int | None = None) -> list[list[int]]:
        """`encode` of each text, in parallel threads over the texts (None: one per core)."""
        # tiktoken encodes in Rust and releases the GIL: threads scale with cores (prepare, packed chat)
        batch = self.enc.encode_ordinary_batch(list(texts), num_threads=num_threads or cpu_cores())
        if prepend_bos:
            for ids in batch:
                ids.insert(0, self.bos_id)
        return batch

    def encode_with_specials(self, text: str) -> list[int]:
        """Ids of `text` in which special-token strings ("<|bos|>", "<|user_start|>", ...) become
        their special ids, the rest encoded as `encode` does: the inverse of `decode` on rendered
        chat prompts. For evaluation prompts only (`eval.lm_adapter`), never for training text."""
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids) -> str:
        """Text of ids (a list, tensor or array; a [1, T] batch too); specials decode to their strings
        and bytes that are not valid UTF-8 to U+FFFD."""
        ids = ids.detach().cpu() if isinstance(ids, torch.Tensor) else ids
        return self.enc.decode(np.asarray(ids, dtype=np.int64).reshape(-1).tolist(), errors="replace")

    def token_bytes(self) -> torch.Tensor:
        """int64 [vocab_size]: the UTF-8 byte length of each token, 0 for special tokens."""
        if self._token_bytes is None:
            # nanochat's table for bits per byte: bpb = sum of the targets' losses in nats /
            # (ln 2 * sum of their token_bytes); a special token stands for no text, so 0 bytes.
            specials = set(self.enc._special_tokens.values())
            self._token_bytes = torch.tensor(
                [0 if i in specials else len(self.enc.decode_single_token_bytes(i))
                 for i in range(self.vocab_size)], dtype=torch.int64)
        return self._token_bytes

    def fingerprint(self) -> str:
        """sha256 of what fixes the ids (pattern, ranks, specials): equal iff they encode alike."""
        # Not the path: the same tokenizer moved to another machine must match, a retrained file
        # under the same name must not (export and resume compare fingerprints).
        h = hashlib.sha256(f"{self.kind}\0{self.enc._pat_str}\0".encode())
        for tok, rank in sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(rank.to_bytes(4, "little") + len(tok).to_bytes(2, "little") + tok)
        h.update(json.dumps(self.enc._special_tokens, sort_keys=True).encode())
        return h.hexdigest()

    def save(self, path: str | os.PathLike) -> Path:
        """Write a BPE tokenizer to `path` (JSON, atomically); returns its absolute path. An unsaved
        tokenizer takes it as its `spec`. bytes / gpt2 have nothing to save: their spec is enough."""
        if self.kind != "bpe":
            raise ConfigError(f"tokenizer={self.kind} has nothing to save: pass "
                              f"tokenizer={self.kind} wherever a tokenizer is asked for")
        ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        # The ranks as base64 in rank order: tiktoken's own format inside a tagged JSON, so that a
        # foreign JSON file is refused in one line and plain tiktoken can rebuild the Encoding.
        obj = {"format": FORMAT, "version": FORMAT_VERSION, "kind": self.kind,
               "pattern": self.enc._pat_str, "special_tokens": self.enc._special_tokens,
               "ranks": [base64.b64encode(tok).decode("ascii") for tok, _ in ranks]}
        path = Path(path).expanduser().absolute()
        atomic_write(path, json.dumps(obj, indent=0).encode())
        if self.spec is None:
            self.spec = str(path)
        return path


def _bpe(ranks: dict[bytes, int], pattern: str, spec: str | None) -> Tokenizer:
    # nanochat's layout: the 256 bytes, the merges, then the 9 specials after the ordinary ids
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    # The name only labels the Encoding (tiktoken's registry is not involved).
    enc = tiktoken.Encoding(f"laplace-bpe-{len(ranks) + len(specials)}", pat_str=pattern,
                            mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer("bpe", enc, "<|bos|>", spec)


def _every_tenth_percent(record: logging.LogRecord) -> bool:
    # rustbpe logs every 1% of the merges: keep 10%, 20%, ... so a long training still reports.
    m = re.match(r"Progress: (\d+)%", record.getMessage())
    return m is None or int(m.group(1)) % 10 == 0


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | os.PathLike | None = None) -> Tokenizer:
    """Train nanochat's BPE on `texts` (streamed: rustbpe counts them in parallel as they come).

    The vocabulary is exactly `vocab_size` ids: 256 bytes, vocab_size - 265 merges, 9 specials.
    Training is deterministic: the same texts give the same ranks. Saved to `path` if given.
    """
    import rustbpe

    if not isinstance(vocab_size, int) or vocab_size <= MIN_VOCAB:
        raise ConfigError(f"vocab_size={vocab_size} must exceed {MIN_VOCAB} (256 bytes + "
                          f"{len(SPECIAL_TOKENS)} special tokens); the paper uses 65536")
    trainer = rustbpe.Tokenizer()
    log = logging.getLogger("rustbpe")  # rustbpe logs through Python's logging (pyo3-log)
    log.addFilter(_every_tenth_percent)
    try:
        trainer.train_from_iterator(iter(texts), vocab_size - len(SPECIAL_TOKENS),
                                    pattern=SPLIT_PATTERN)
    finally:
        log.removeFilter(_every_tenth_percent)
    ranks = {bytes(tok): rank for tok, rank in trainer.get_mergeable_ranks()}
    if len(ranks) + len(SPECIAL_TOKENS) != vocab_size:
        # Too little text: every pair left occurs once. A smaller vocabulary than asked would
        # silently change the model's embedding table, so ask for a consistent setting instead.
        raise ConfigError(f"vocab_size={vocab_size} needs more training text: it yielded only "
                          f"{len(ranks) + len(SPECIAL_TOKENS)} tokens; lower vocab_size or give "
                          f"more text (tokenizer_train_chars / max_docs)")
    tok = _bpe(ranks, trainer.get_pattern(), None)
    if path is not None:
        tok.save(path)
    return tok


def _gpt2() -> Tokenizer:
    # tiktoken downloads GPT-2's BPE files on first use into its cache; a compute node without a
    # network needs that cache filled elsewhere, which the error says how to do.
    try:
        enc = tiktoken.get_encoding("gpt2")
    except (OSError, ValueError) as e:  # requests' errors are OSErrors; ValueError: bad hash
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") \
            or os.path.join(tempfile.gettempdir(), "data-gym-cache")
        raise ConfigError(
            f"tokenizer=gpt2: tiktoken could not load its BPE files from the cache {cache} "
            f"({type(e).__name__}); set TIKTOKEN_CACHE_DIR to a shared folder and run "
            f"python -c 'import tiktoken; tiktoken.get_encoding(\"gpt2\")' once where there is "
            f"internet (or copy that folder here)") from None
    return Tokenizer("gpt2", enc, "<|endoftext|>", "gpt2")


def _read_file(path: Path) -> Tokenizer:
    where = f"tokenizer={path}"
    try:
        obj = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError):
        obj = None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ConfigError(f"{where} is not a laplace tokenizer file (no \"format\": \"{FORMAT}\"); "
                          f"make one with python prepare.py, or use bytes | gpt2")
    if obj.get("version") != FORMAT_VERSION or obj.get("kind") != "bpe":
        raise ConfigError(f"{where} has version {obj.get('version')} / kind {obj.get('kind')}; this "
                          f"code reads version {FORMAT_VERSION} / bpe: re-create it with "
                          f"python prepare.py")
    try:
        ranks = {base64.b64decode(t, validate=True): r for r, t in enumerate(obj["ranks"])}
        pattern, specials = obj["pattern"], obj["special_tokens"]
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where} is damaged ({type(e).__name__}: {e}); re-create it with "
                          f"python prepare.py") from None
    expected = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    if len(ranks) != len(obj["ranks"]) or specials != expected:
        raise ConfigError(f"{where} is damaged (duplicate ranks or special tokens not after the "
                          f"ranks); re-create it with python prepare.py")
    return _bpe(ranks, pattern, str(path))


@functools.lru_cache(maxsize=16)
def _load_cached(spec: str, _stamp: tuple | None) -> Tokenizer:
    if spec == "bytes":  # the 256 bytes as ranks (no merges), then the specials at 256..264:
        # <|bos|> = 256 as in the built-in byte-level text (laplace.data.text), so its models stay valid
        ranks = {bytes([i]): i for i in range(256)}
        enc = tiktoken.Encoding("laplace-bytes", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                                special_tokens={name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)})
        return Tokenizer("bytes", enc, "<|bos|>", "bytes")
    if spec == "gpt2":
        return _gpt2()
    return _read_file(Path(spec))


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """The tokenizer named by `spec`: "bytes", "gpt2" or the path of a saved BPE file.

    Cached: the same spec (and, for a file, the same size and modification time) returns the
    same object, so call it freely; a re-trained file is read again.
    """
    spec = os.fspath(spec)
    if spec in ("bytes", "gpt2"):
        return _load_cached(spec, None)
    path = Path(spec).expanduser().absolute()
    if not path.is_file():
        raise DatasetNotFoundError(
            f"tokenizer file not found: looked for {path}; make one with python "
            f"prepare.py source=... (it writes <out>/tokenizer.json), or set the "
            f"tokenizer key to bytes | gpt2 | an existing file")
    st = path.stat()  # size and time in the cache key: a re-trained file is read again
    return _load_cached(str(path), (st.st_size, st.st_mtime_ns))


def capped_texts(texts: Iterable[str], max_chars: int, doc_chars: int) -> Iterator[str]:
    """The texts that train a BPE, as nanochat feeds them: each cut to its first `doc_chars`
    characters, stopping once `max_chars` characters have been given."""
    total = 0
    for text in texts:
        text = text[:doc_chars]
        yield text
        total += len(text)
        if total >= max_chars:
            return


def tokenizer_from_config(cfg: Mapping[str, Any]):
    """The tokenizer a run was trained with, from its resolved config (a checkpoint's
    `config`, a dict or DictConfig): `data.tokenizer`, or byte-level when the run predates the
    key (the byte-level `data=pydoc_text` runs)."""
    return load_tokenizer((cfg.get("data") or {}).get("tokenizer") or "bytes")
