"""Throughput of the GPT data path: TokenStream delivering batches, and BPE tokenization.

    .venv/bin/python scripts/bench_tokens.py                       # ~10 s on 2 cores, 200 MB of disk
    .venv/bin/python scripts/bench_tokens.py --tokens 50_000_000 --vocab 8192

(a) --tokens random uint16 tokens written as shards (write_shard) to a temp folder, read by
    TokenStream with seq_len 2048 and micro batch 32 for one epoch: tokens/s delivered and the
    process memory before / after. Anonymous memory (RssAnon) must stay flat whatever the dataset
    size; the mapped shards show up as RssFile: clean page cache the OS reclaims, not a leak.
(b) A BPE trained on the built-in help text (laplace.data.text.pydoc_documents), then
    encode_batch over the help text repeated to --chars characters with 1, 2, ... threads:
    tokens/s and tokens/s per thread (python -m laplace.data.prepare prints the same figure).
(a) is laplace.bench.pipeline.bench_stream, which `python -m laplace.bench` records as well.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

from laplace.bench.pipeline import bench_stream, stream_lines  # noqa: E402


def bench_tokenizer(vocab: int, chars: int, threads: list[int]) -> None:
    from laplace.data.text import pydoc_documents
    from laplace.tokenizer import train_bpe

    t = time.perf_counter()
    tok = train_bpe(pydoc_documents(train=True), vocab)
    print(f"(b) BPE vocab {vocab:,} trained on the help text in {time.perf_counter() - t:.2f} s")
    docs = pydoc_documents(train=True) + pydoc_documents(train=False)
    reps = max(1, chars // sum(map(len, docs)))
    texts = docs * reps
    n_chars = sum(map(len, texts))
    tok.encode_batch(texts[:50])  # warm up the regex and thread pool
    for n in threads:
        t = time.perf_counter()
        ids = tok.encode_batch(texts, prepend_bos=True, num_threads=n)
        dt = time.perf_counter() - t
        n_tok = sum(map(len, ids))
        print(f"    encode_batch, {n} thread{'s' * (n > 1)}: {n_tok:,} tokens ({n_chars:,} chars, "
              f"{n_chars / n_tok:.2f} chars/token) in {dt:.2f} s = {n_tok / dt:,.0f} tokens/s, "
              f"{n_tok / dt / n:,.0f} tokens/s per thread")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--chars", type=int, default=20_000_000, help="characters to tokenize in (a)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, default=100_000_000, help="tokens on disk in (b)")
    p.add_argument("--shard-tokens", type=int, default=25_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    print(f"{os.cpu_count()} CPUs")
    # The stream first: its memory figures are then not those of (a)'s token lists.
    print("\n".join(stream_lines(bench_stream(args.tokens, args.shard_tokens, args.seq_len, args.batch))))
    bench_tokenizer(args.vocab, args.chars, args.threads)


if __name__ == "__main__":
    main()
