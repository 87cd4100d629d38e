"""The data side of the benchmark: the LM loader's and the tokenizer's tokens/s, the analysis accumulator.

bench_stream: --tokens random uint16 tokens written as shards (write_shard) to a temp folder,
    read by TokenStream for one epoch: tokens/s delivered, and the process memory before /
    after. Anonymous memory (RssAnon) must stay flat whatever the dataset size; the mapped
    shards show up as RssFile: clean page cache the OS reclaims, not a leak.
bench_tokenizer: a BPE trained on the built-in help text (laplace.data.text.pydoc_documents),
    then encode_batch over that text repeated to --tokenizer-chars characters with 1, 2, ...
    threads: tokens/s and tokens/s per thread.
analysis_one: N random float32 tokens (1000 sequences spanning batch borders, 100 classes, one
    class per sequence; token = class mean + sequence offset + noise) fed in batches through
    analysis.streaming.GeometryAccumulator (all metrics): tokens/s of update(), against the
    tokens/s of the bare float64 X^T X matmul (addmm) of the same batches, the update's main
    cost; the time of compute() and the peak memory. Run in a fresh process per N
    (`analysis_subprocess`) so that the peaks do not mix.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ANALYSIS_METRICS = ("anova", "nc", "cdnv", "lc", "spectral")


def mem() -> dict[str, float]:
    """MiB from /proc/self/status: VmRSS (all), RssAnon (heap), RssFile (mapped files), VmHWM."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def bench_stream(n_tokens: int, shard_tokens: int, seq_len: int, batch: int) -> dict:
    """TokenStream over n_tokens random tokens in shards of shard_tokens: one epoch's tokens/s."""
    from laplace.data.shards import TokenStream, list_shards, write_shard

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="bench_tokens_") as root:
        t = time.perf_counter()
        for i, start in enumerate(range(0, n_tokens, shard_tokens)):
            n = min(shard_tokens, n_tokens - start)
            write_shard(os.path.join(root, "train", f"shard_{i:05d}.npy"),
                        rng.integers(0, 2**16, n, dtype=np.uint16), vocab_size=2**16)
        write_s = time.perf_counter() - t
        files = list_shards(root, "train")
        size = sum(f.stat().st_size for f in files)
        before = mem()
        stream = TokenStream(files, seq_len=seq_len, micro_batch_size=batch, loop=False)
        t, delivered, checksum = time.perf_counter(), 0, 0
        for x, y in stream:
            delivered += x.numel()
            checksum += int(x[0, 0])  # touch the batch
        dt = time.perf_counter() - t
        after = mem()
    return dict(tokens_on_disk=n_tokens, shards=len(files), shard_mib=size / 2**20, write_s=write_s,
                seq_len=seq_len, micro_batch=batch, tokens=delivered,
                batches=stream.micro_batches_per_epoch, seconds=dt, tokens_per_s=delivered / dt,
                batches_per_s=stream.micro_batches_per_epoch / dt, mem_before_mib=before,
                mem_after_mib=after, anon_growth_mib=after["RssAnon"] - before["RssAnon"])


def bench_tokenizer(vocab: int, chars: int, threads: list[int]) -> dict:
    """BPE training time on the help text, then encode_batch tokens/s with each thread count."""
    from laplace.data.text import pydoc_documents
    from laplace.tokenizer import train_bpe

    t = time.perf_counter()
    tok = train_bpe(pydoc_documents(train=True), vocab)
    train_s = time.perf_counter() - t
    docs = pydoc_documents(train=True) + pydoc_documents(train=False)
    texts = docs * -(-chars // sum(map(len, docs)))  # at least `chars` characters
    n_chars = sum(map(len, texts))
    tok.encode_batch(texts[:50])  # warm up the regex and the thread pool
    runs = []
    for n in threads:
        t = time.perf_counter()
        ids = tok.encode_batch(texts, prepend_bos=True, num_threads=n)
        dt = time.perf_counter() - t
        n_tok = sum(map(len, ids))
        runs.append(dict(threads=n, tokens=n_tok, seconds=dt, tokens_per_s=n_tok / dt,
                         tokens_per_s_per_thread=n_tok / dt / n))
    return dict(vocab=vocab, train_s=train_s, chars=n_chars, chars_per_token=n_chars / runs[0]["tokens"],
                runs=runs)


def peak_rss_mib() -> float:
    """This process's peak resident set size. VmHWM, not ru_maxrss: on Linux ru_maxrss survives
    fork + exec, so a child started by a large parent would report the parent's peak."""
    try:
        return mem()["VmHWM"]
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def analysis_one(N: int, D: int, n_seq: int, n_cls: int, batch: int, device: str,
                 matmul_tokens: int | None = None) -> dict:
    """GeometryAccumulator over N tokens (see the module docstring); call in a fresh process
    for a meaningful peak. The matmul reference runs over the first `matmul_tokens` (default
    all) of the same batches: a rate, so a prefix of them measures it as well."""
    from analysis.streaming import GeometryAccumulator

    torch.manual_seed(0)
    seq_len = max(1, N // n_seq)
    seq_cls = torch.arange(n_seq, device=device) % n_cls
    W = torch.randn(n_cls, D, device=device)
    seq_mu = W[seq_cls] + 0.5 * torch.randn(n_seq, D, device=device)  # class + sequence offsets
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.memory_allocated()
    base_mib = peak_rss_mib()  # torch + data set-up
    acc = GeometryAccumulator(D, metrics=ANALYSIS_METRICS, device=device)
    t_update = 0.0
    for start in range(0, N, batch):
        idx = torch.arange(start, min(N, start + batch), device=device)
        seq = (idx // seq_len).clamp_max(n_seq - 1)
        x = torch.randn(idx.numel(), D, device=device) + seq_mu[seq]
        _sync(device)
        t0 = time.perf_counter()
        acc.update(x, seq, seq_cls[seq])
        _sync(device)
        t_update += time.perf_counter() - t0
    t0 = time.perf_counter()
    out = acc.compute(weight=W, unembedding=W)
    _sync(device)
    t_compute = time.perf_counter() - t0
    peak_mib = peak_rss_mib()
    cuda_peak = (torch.cuda.max_memory_allocated() - cuda_before) / 2**20 if cuda else None

    # The reference: the float64 scatter update X^T X of the same batch shapes, nothing else.
    m_tokens = min(N, matmul_tokens or N)
    xtx = torch.zeros(D, D, dtype=torch.float64, device=device)
    x = torch.randn(min(batch, m_tokens), D, dtype=torch.float64, device=device)
    xtx.addmm_(x.T, x)  # warm-up
    t_mm, done = 0.0, 0
    while done < m_tokens:
        xb = x[:min(batch, m_tokens - done)]
        _sync(device)
        t0 = time.perf_counter()
        xtx.addmm_(xb.T, xb)
        _sync(device)
        t_mm += time.perf_counter() - t0
        done += xb.shape[0]
    update_tps, matmul_tps = N / t_update, m_tokens / t_mm
    return dict(tokens=N, dim=D, seqs=n_seq, classes=n_cls, batch=batch, device=device,
                threads=torch.get_num_threads(), metrics=list(ANALYSIS_METRICS),
                update_s=t_update, update_tokens_per_s=update_tps,
                update_gflops=2 * D * D * update_tps / 1e9,
                matmul_tokens=m_tokens, matmul_tokens_per_s=matmul_tps,
                matmul_gflops=2 * D * D * matmul_tps / 1e9,
                update_vs_matmul=update_tps / matmul_tps, compute_s=t_compute,
                peak_rss_mib=peak_mib, rss_before_accumulator_mib=base_mib,
                cuda_peak_mib=cuda_peak, within_seq_share=float(out["within_seq_share"]),
                n_pcs_099=float(out["n_pcs_0.99"]))


def analysis_subprocess(N: int, D: int, n_seq: int, n_cls: int, batch: int, device: str,
                        threads: int | None, matmul_tokens: int | None) -> dict:
    """analysis_one in a fresh `python -m bench --analysis-one` process."""
    cmd = [sys.executable, "-m", "bench", "--analysis-one", str(N), "--analysis-dim", str(D),
           "--analysis-seqs", str(n_seq), "--analysis-classes", str(n_cls), "--analysis-batch", str(batch),
           "--device", device]
    if threads:
        cmd += ["--threads", str(threads)]
    if matmul_tokens:
        cmd += ["--analysis-matmul-tokens", str(matmul_tokens)]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
