"""Documents -> token shards: train shard i holds training documents [i * D, (i + 1) * D), each
written atomically, so a re-run keeps the finished shards and skips their documents."""
import itertools
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tqdm.auto import tqdm

from laplace.data.shards import shard_dtype, write_shard
from laplace.errors import ConfigError
from laplace.tokenizer import Tokenizer


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.npy"


def encode_docs(tok: Tokenizer, docs: list[str], dtype: np.dtype, threads: int, stats: Counter) -> np.ndarray:
    """<|bos|> + the ids of each document, concatenated, as one array of `dtype`; adds the documents,
    tokens and seconds to `stats` (prepare's closing summary)."""
    t = time.perf_counter()
    lists = tok.encode_batch(docs, prepend_bos=True, num_threads=threads)  # threads: no GIL in tiktoken
    arr = np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=sum(map(len, lists)))
    stats.update(docs=len(docs), tokens=len(arr), seconds=time.perf_counter() - t)
    return arr


def _shard_tokens(path: Path) -> int | None:
    """Length of a finished shard (header only), None if missing or unreadable."""
    try:
        return len(np.load(path, mmap_mode="r"))
    except (OSError, ValueError):  # absent, or not a whole .npy: written again
        return None


def write_train(src, tok: Tokenizer, folder: Path, docs_per_shard: int, max_docs: int | None,
                batch_docs: int, threads: int, stats: Counter, progress: bool) -> list[dict]:
    """Train shards in `folder` (docs/text_data.md); returns [{file, docs, tokens}]."""
    D, dtype = docs_per_shard, shard_dtype(tok.vocab_size)
    limit = max_docs if max_docs is not None else float("inf")
    shards: list[dict] = []
    # The shards a killed run finished (each written atomically: whole or absent) are kept.
    while (n := _shard_tokens(folder / shard_name(len(shards)))) is not None:
        shards.append({"file": f"{folder.name}/{shard_name(len(shards))}", "docs": D, "tokens": n})
    if shards:  # every shard but the last holds D documents: count only the last (ordinary text
        # never encodes to <|bos|>, so the BOS count is the document count)
        last = np.load(folder.parent / shards[-1]["file"], mmap_mode="r")
        shards[-1]["docs"] = int(np.count_nonzero(last == tok.bos_id))
        if shards[-1]["docs"] < D:
            return shards  # the source ran out in the last shard: finished
    start = len(shards) * D  # shard i holds documents [i * D, (i + 1) * D): resume at the next one
    if start >= limit:
        return shards
    total = max_docs if src.num_train is None else min(src.num_train, limit)  # None: unknown (streamed)
    bar = tqdm(total=total, initial=start, desc="train docs", unit="doc", unit_scale=True, leave=False,
               disable=not progress)
    parts, docs, seen = [], 0, start
    for batch in src.train_batches(start, batch_docs):
        batch = batch[:max(int(min(limit, seen + len(batch)) - seen), 0)]  # stop at max_docs
        seen += len(batch)
        while batch:  # a batch may finish one shard and start the next
            take = min(len(batch), D - docs)
            parts.append(encode_docs(tok, batch[:take], dtype, threads, stats))
            docs, batch = docs + take, batch[take:]
            bar.update(take)
            if docs == D:
                shards.append(_flush(folder, len(shards), parts, docs, tok.vocab_size))
                parts, docs = [], 0
        if seen >= limit:
            break
    if docs:
        shards.append(_flush(folder, len(shards), parts, docs, tok.vocab_size))
    bar.close()
    return shards


def _flush(folder: Path, i: int, parts: list[np.ndarray], docs: int, vocab_size: int) -> dict:
    arr = np.concatenate(parts)
    write_shard(folder / shard_name(i), arr, vocab_size)
    return {"file": f"{folder.name}/{shard_name(i)}", "docs": docs, "tokens": len(arr)}


def write_val(src, tok: Tokenizer, folder: Path, val_docs: int, batch_docs: int, threads: int,
              stats: Counter) -> list[dict]:
    """The validation shard: the first val_docs documents of the validation split, written (or
    kept, when an earlier run finished it) by write_train as one shard of val_docs documents."""
    if val_docs == 0:
        return []
    # The validation split as write_train's source: one shard of val_docs documents, so it is only
    # ever read from document 0 (a finished shard returns before any read).
    val = SimpleNamespace(num_train=None, train_batches=lambda start, batch: src.val_batches(batch))
    shards = write_train(val, tok, folder, val_docs, val_docs, batch_docs, threads, stats, progress=False)
    if not shards:
        raise ConfigError(f"source={src.describe()} has no validation documents; give it a "
                          f"validation split (val_split) or set val_docs=0")
    if shards[0]["tokens"] <= shards[0]["docs"]:  # <|bos|> alone per document: the text column is empty
        (folder.parent / shards[0]["file"]).unlink()  # not kept for a re-run to take as finished
        raise ConfigError(f"source={src.describe()}: the {shards[0]['docs']} validation documents are empty (no "
                          f"text in text_column); check val_split / text_column, or set val_docs=0")
    return shards
