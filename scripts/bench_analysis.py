"""Throughput and peak memory of the streaming geometry accumulator (all metrics).

Feeds N random float32 tokens (D = 768, 1000 sequences spanning batch borders, 100 classes, one
class per sequence; token = class mean + sequence offset + noise) in batches through GeometryAccumulator and prints tokens/s of update(),
the time of compute() and the peak RSS. Each N runs in a fresh process so peaks do not mix.

    python scripts/bench_analysis.py                    # N = 1e5 and 1e6 on CPU (or CUDA)
    python scripts/bench_analysis.py --tokens 100000 --batch 8192 --device cpu
"""
import argparse
import resource
import subprocess
import sys
import time

import torch

from analysis.streaming import GeometryAccumulator

METRICS = ("anova", "nc", "cdnv", "lc", "spectral")


def run_one(N: int, D: int, n_seq: int, n_cls: int, batch: int, device: str):
    torch.manual_seed(0)
    seq_len = N // n_seq
    seq_cls = torch.arange(n_seq, device=device) % n_cls
    W = torch.randn(n_cls, D, device=device)
    seq_mu = W[seq_cls] + 0.5 * torch.randn(n_seq, D, device=device)  # class + sequence offsets
    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # torch + data set-up
    acc = GeometryAccumulator(D, metrics=METRICS, device=device)
    t_update = 0.0
    for start in range(0, N, batch):
        idx = torch.arange(start, min(N, start + batch), device=device)
        seq = idx // seq_len
        x = torch.randn(idx.numel(), D, device=device) + seq_mu[seq]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        acc.update(x, seq, seq_cls[seq])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t_update += time.perf_counter() - t0
    t0 = time.perf_counter()
    out = acc.compute(weight=W, unembedding=W)
    t_compute = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(f"N={N:>9,d} D={D} seqs={n_seq} classes={n_cls} device={device} threads={torch.get_num_threads()}: "
          f"update {N / t_update:,.0f} tokens/s ({t_update:.1f} s), compute {t_compute:.2f} s, "
          f"peak RSS {rss_mb:,.0f} MiB (before the accumulator {base_mb:,.0f} MiB), within_seq_share {out['within_seq_share']:.4f}, "
          f"n_pcs_0.99 {out['n_pcs_0.99']:.0f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--seqs", type=int, default=1000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--one", action="store_true", help="run a single N in this process")
    a = p.parse_args()
    if a.one:
        run_one(a.tokens[0], a.dim, a.seqs, a.classes, a.batch, a.device)
        return
    for N in a.tokens:  # a fresh process per N: ru_maxrss is a process-lifetime peak
        args = ["--one", "--tokens", str(N), "--dim", str(a.dim), "--seqs", str(a.seqs),
                "--classes", str(a.classes), "--batch", str(a.batch), "--device", a.device]
        subprocess.run([sys.executable, __file__, *args], check=True)


if __name__ == "__main__":
    main()
