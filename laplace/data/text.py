"""`data=pydoc_text`: the English help topics that ship with every Python (`pydoc_data.topics`,
about 700 kB of prose and code), as fixed-length windows of byte tokens for language modelling.

The language analogue of `data=digits`: real text that needs no download. Tokens are UTF-8
bytes (vocab 256) plus one <|bos|> token (id 256) that starts every document, because tiktoken's
BPE files and nanochat's tokenizer must be downloaded; the FineWeb-Edu loader uses a real BPE.
Each topic is one document; every 10th document (sorted by topic name) is held out for
validation, so the split never depends on the run's seed.
"""
import functools

import torch
from torch.utils.data import Dataset

from laplace.errors import ConfigError

BOS = 256
VOCAB_SIZE = 257


def pydoc_documents(train: bool = True, val_every: int = 10) -> list[str]:
    from pydoc_data.topics import topics

    # One document per topic, by name; every 10th held out: a split that never depends on a seed.
    docs = [topics[k] for k in sorted(topics)]
    return [d for i, d in enumerate(docs) if (i % val_every == val_every - 1) != train]


@functools.lru_cache(maxsize=1)  # read once per process: the train and the validation split come from it
def stdlib_texts() -> tuple[str, ...]:
    """Python's standard-library sources: every non-empty `*.py` file under sysconfig's stdlib
    folder, by path: real text found on every machine (~1,790 files, ~31 M characters for Python 3.11)."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    # Without site-packages / dist-packages: what is installed there differs from machine to
    # machine (11,563 of 13,353 files, 130 of 161 M characters on ours).
    files = sorted(f for f in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts))
    return tuple(t for t in (f.read_text(errors="replace") for f in files) if t.strip())


STDLIB_PIECE_CHARS, STDLIB_ORDER_SEED = 2000, 0
# What decides the stdlib documents beyond the Python version: prepare pins it (BuiltinSource.fingerprint),
# so that shards written under another layout are refused, not resumed into.
STDLIB_LAYOUT = (f"stdlib split by path, files cut into pieces of <= {STDLIB_PIECE_CHARS} characters, "
                 f"each split's pieces in a random order (seed {STDLIB_ORDER_SEED})")


def stdlib_documents(train: bool = True, val_every: int = 4, seed: int = STDLIB_ORDER_SEED,
                     max_chars: int = STDLIB_PIECE_CHARS) -> list[str]:
    """stdlib_texts() split by path position (every val_every-th file is validation), each file cut
    at line ends into pieces of at most max_chars, each split's pieces then in a fixed random order."""
    import random

    files = [d for i, d in enumerate(stdlib_texts()) if (i % val_every == val_every - 1) != train]
    # Token shards are read in order (TokenStream expects them shuffled when written, as
    # FineWeb-Edu's are). By path a package's modules come together, and whole files are long
    # (median 6.8 k characters, the largest ~220 k tokens): a small batch (16 x 128 tokens) read
    # one file for tens of steps and the validation curve rose and fell with it (the long
    # miniature, docs/LOG.md). Pieces of 2,000 characters (~600 tokens, about a FineWeb-Edu
    # document), shuffled, put several files in every batch.
    docs = [p for d in files for p in _pieces(d, max_chars) if p.strip()]
    random.Random(seed).shuffle(docs)
    return docs


def _pieces(text: str, max_chars: int) -> list[str]:
    """text cut at line ends into pieces of at most max_chars ("".join gives it back); a line
    longer than that is a piece of its own."""
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        if cur and n + len(line) > max_chars:
            out.append("".join(cur))
            cur, n = [], 0
        cur.append(line)
        n += len(line)
    if cur:
        out.append("".join(cur))
    return out


class TokenWindows(Dataset):
    """Windows of seq_len + 1 tokens of one token stream, consecutive windows sharing one token so
    that every token is a target once: item i is (x, y), y = x shifted by one. The tail shorter
    than a window is dropped. The in-memory streams' one implementation (data=pydoc_text here,
    packed conversations in laplace.data.chat; token shards stream: laplace.data.shards).

    Args:
        tokens: the stream, an integer tensor.
        seq_len: the model's context.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, int(seq_len)
        self.n = max(0, (len(tokens) - 1) // self.seq_len)

    def __len__(self) -> int:
        return self.n

    def window(self, i: int) -> slice:
        if not 0 <= i < self.n:
            raise IndexError(f"window {i} out of range ({self.n} windows)")
        return slice(i * self.seq_len, (i + 1) * self.seq_len + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[self.window(i)].long()
        return w[:-1], w[1:]


def build_pydoc_text(train: bool, seq_len: int) -> TokenWindows:
    """data=pydoc_text: the help topics' bytes, <|bos|> before each, as windows."""
    # ids 0-255 are the UTF-8 bytes, <|bos|> before each document as in the token shards
    ids = [t for doc in pydoc_documents(train) for t in [BOS, *doc.encode("utf-8")]]
    # In memory for the whole run (~450 k tokens): int16, a quarter of int64's bytes.
    ds = TokenWindows(torch.tensor(ids, dtype=torch.int16), seq_len)
    if len(ds) == 0:
        raise ConfigError(f"data.seq_len={seq_len} is longer than the text ({len(ids)} tokens)")
    return ds
