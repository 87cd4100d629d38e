"""Throughput and peak memory of the streaming geometry accumulator (all metrics).

Feeds N random float32 tokens (D = 768, 1000 sequences spanning batch borders, 100 classes, one
class per sequence; token = class mean + sequence offset + noise) in batches through GeometryAccumulator and prints tokens/s of update(),
the same against the bare float64 X^T X matmul of those batches, the time of compute() and the
peak RSS. Each N runs in a fresh process so peaks do not mix. The measurement is
laplace.bench.pipeline.analysis_one, which `python -m laplace.bench` records as well.

    python scripts/bench_analysis.py                    # N = 1e5 and 1e6 on CPU (or CUDA)
    python scripts/bench_analysis.py --tokens 100000 --batch 8192 --device cpu
"""
import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

from laplace.bench.pipeline import analysis_one  # noqa: E402


def run_one(N: int, D: int, n_seq: int, n_cls: int, batch: int, device: str):
    r = analysis_one(N, D, n_seq, n_cls, batch, device)
    print(f"N={N:>9,d} D={D} seqs={n_seq} classes={n_cls} device={device} threads={r['threads']}: "
          f"update {r['update_tokens_per_s']:,.0f} tokens/s ({r['update_s']:.1f} s; the bare X^T X "
          f"{r['matmul_tokens_per_s']:,.0f} tokens/s, ratio {r['update_vs_matmul']:.2f}), compute "
          f"{r['compute_s']:.2f} s, peak RSS {r['peak_rss_mib']:,.0f} MiB (before the accumulator "
          f"{r['rss_before_accumulator_mib']:,.0f} MiB), within_seq_share {r['within_seq_share']:.4f}, "
          f"n_pcs_0.99 {r['n_pcs_099']:.0f}", flush=True)


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
