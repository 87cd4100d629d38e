"""Command line of `python -m bench` (see the package docstring): runs the sections, writes the record."""
import argparse
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from train.logger import git_commit

from . import report

SECTIONS = ("vit", "gpt_memory", "loader")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description="What Laplacian heads cost, ours against "
                                "timm, the GPT's memory against nanochat's, a loader worker's images/s.")
    # Positional names too: issue 42 writes the command as `python -m bench gpt_memory`.
    p.add_argument("only", nargs="*", metavar="SECTION", help=f"sections to run (default all): {', '.join(SECTIONS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # One thread by default: on a shared host, idle OpenMP threads spin while they wait for a core
    # and the timings wander; a loader worker runs with one thread anyway.
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the timed code (Timer's; 1 on a shared host)")
    p.add_argument("--smoke", action="store_true", help="tiny models, few images, brief timings (tests)")
    p.add_argument("--min-time", type=float, default=None, help="seconds of each Timer measurement (1; smoke 0.01)")
    p.add_argument("--rounds", type=int, default=4, help="vit, gpt_memory: measurements of each model, taken in turns")
    p.add_argument("--families", nargs="+", choices=("vits", "vitb"), default=["vits", "vitb"])
    p.add_argument("--batch-size", type=int, default=None, help="vit: images per step (CUDA 128, CPU 2)")
    p.add_argument("--img-size", type=int, default=None, help="vit: resolution (224; smoke 32)")
    p.add_argument("--compile", action="store_true", help="vit: time torch.compile'd models")
    p.add_argument("--depths", type=int, nargs="+", default=None, help="gpt_memory: GPT depths (4 8; smoke 1)")
    p.add_argument("--gpt-families", nargs="+", choices=("gpt", "gpt26"), default=["gpt"],
                   help="gpt_memory: gpt (2025, nanochat eec0c79) and/or gpt26 (nanochat 92d63d4's)")
    p.add_argument("--nanochat", metavar="DIR", help="gpt_memory: a folder holding nanochat's nanochat/ (eec0c79)")
    p.add_argument("--seq-len", type=int, default=None, help="gpt_memory: tokens per sequence (128; smoke 16)")
    p.add_argument("--vocab-size", type=int, default=None, help="gpt_memory: vocabulary (65536; smoke 256)")
    p.add_argument("--images", type=int, default=None, help="loader: JPEG files written (48; smoke 3)")
    p.add_argument("--out", default="docs/benchmarks", help="folder of the records")
    p.add_argument("--note", default="", help="free text kept in the record (e.g. the machine's load)")
    args = p.parse_args(argv)
    wrong = [s for s in args.only if s not in SECTIONS]
    if wrong:
        p.error(f"section {wrong[0]!r}: choose from {', '.join(SECTIONS)}")
    args.sections = args.only or list(SECTIONS)
    try:
        cuda = torch.device(args.device).type == "cuda"
    except RuntimeError as e:
        p.exit(2, f"error: --device {args.device}: {str(e).splitlines()[0]}; use cuda, cuda:N or cpu\n")
    if cuda and not torch.cuda.is_available():
        p.exit(2, f"error: --device {args.device}: this machine has no CUDA device torch can use; "
                  f"run on a GPU machine or pass --device cpu\n")
    # Defaults that depend on --smoke and the device (None: not given on the command line).
    # Full sizes: ViT-B at 128 x 224 is the GPU protocol, 2 images keep a CPU run to minutes. The
    # GPT's count is per token (SDPA keeps its output and a log-sum-exp per row, no N x N matrix),
    # so 128 tokens suffice; nanochat's 65,536-token vocabulary keeps the logits' share as in the
    # paper's runs.
    small = dict(min_time=0.01, img_size=32, batch_size=2, depths=[1], seq_len=16, vocab_size=256, images=3)
    full = dict(min_time=1.0, img_size=224, batch_size=128 if cuda else 2, depths=[4, 8], seq_len=128,
                vocab_size=65536, images=48)
    for key, value in (small if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # On a CPU shared with other jobs, wall time counts their load too; one thread's CPU time does
    # not (their contention for caches and memory stays). A GPU, or several threads: wall time.
    args.clock = "wall" if cuda or args.threads > 1 else "cpu"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from . import gpt_memory, images, vit  # after parsing: --help and argument errors stay quick

    # What a reader needs to compare two records: when, what ran, on which code and machine.
    record = dict(date=datetime.now().astimezone().isoformat(timespec="seconds"),
                  command=shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)]),
                  commit=git_commit(), machine=report.machine(args.device), note=args.note,
                  device=torch.device(args.device).type, smoke=args.smoke, args=vars(args))
    m = record["machine"]
    print(f"[bench] {m.get('gpu') or m['cpu']} ({m['cpu_capability']}), {args.threads} thread(s): "
          f"{', '.join(args.sections)}", flush=True)
    tables = {}  # section -> its DataFrame: the record's JSON and Markdown are both views of it
    for name in args.sections:
        t0 = time.perf_counter()
        tables[name] = dict(vit=vit, gpt_memory=gpt_memory, loader=images)[name].run(args)
        print(f"[bench] {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    files = report.write(record, tables, Path(args.out))
    print("\n" + files[1].read_text() + f"\n[bench] records: {files[0]} and {files[1]}", flush=True)
    return dict(record, tables=tables, files=files)
