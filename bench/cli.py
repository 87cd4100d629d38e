"""Command line of `python -m bench` (see the package docstring)."""
from __future__ import annotations

import argparse
import gc
import json
import math
import time
from datetime import datetime
from pathlib import Path

import torch

from laplace.dist import use_tf32

from . import report
from .pipeline import analysis_one, analysis_subprocess, bench_stream, bench_tokenizer

SECTIONS = ("layer", "step", "gpt_memory", "loader", "images", "tokenizer", "analysis")
FAMILIES = ("vits", "vitb", "gpt")
ROOT = Path(__file__).resolve().parents[1]

# Defaults per device; --smoke replaces them all with tiny sizes.
DEFAULTS = {
    "cuda": dict(dtype="bf16", batch_size=128, img_size=224, gpt_batch_size=16, seq_len=2048, gpt_depth=20,
                 vocab_size=65536, steps=20, warmup=5, layer_steps=50, layer_warmup=10,
                 loader_tokens=100_000_000, loader_seq_len=2048, loader_batch=32,
                 tokenizer_vocab=4096, tokenizer_chars=20_000_000, tokenizer_threads=[1, 2],
                 analysis_tokens=[100_000, 1_000_000], analysis_dim=768, analysis_seqs=1000,
                 analysis_classes=100, analysis_batch=4096, analysis_matmul_tokens=None, memory_depths=[20],
                 images_files=48, images_items=300, images_warmup=10, images_diff_items=50),
    "cpu": dict(dtype="fp32", batch_size=2, img_size=224, gpt_batch_size=2, seq_len=128, gpt_depth=8,
                vocab_size=65536, steps=3, warmup=1, layer_steps=30, layer_warmup=3,
                loader_tokens=20_000_000, loader_seq_len=2048, loader_batch=32,
                tokenizer_vocab=4096, tokenizer_chars=20_000_000, tokenizer_threads=[1, 2],
                analysis_tokens=[100_000, 1_000_000], analysis_dim=768, analysis_seqs=1000,
                analysis_classes=100, analysis_batch=4096, analysis_matmul_tokens=100_000, memory_depths=[4, 8],
                images_files=48, images_items=200, images_warmup=10, images_diff_items=50),
    "smoke": dict(dtype="fp32", batch_size=2, img_size=32, gpt_batch_size=2, seq_len=16, gpt_depth=4,
                  vocab_size=256, steps=1, warmup=1, layer_steps=1, layer_warmup=1,
                  loader_tokens=20_000, loader_seq_len=64, loader_batch=4,
                  tokenizer_vocab=512, tokenizer_chars=20_000, tokenizer_threads=[1],
                  analysis_tokens=[2_000, 4_000], analysis_dim=32, analysis_seqs=10,
                  analysis_classes=5, analysis_batch=512, analysis_matmul_tokens=None, memory_depths=[1],
                  images_files=3, images_items=2, images_warmup=1, images_diff_items=1),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench",
                                description="Speed and memory of Laplacian heads, our models against timm's, the "
                                            "LM loader, the image input paths, the tokenizer and the analysis "
                                            "accumulator, written as records.")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="bf16 = bf16 autocast; default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="measure torch.compile'd models as well as eager")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--smoke", action="store_true", help="everything tiny (1-block models, few tokens, 1 step)")
    g = p.add_argument_group("models (defaults: CUDA / CPU)")
    g.add_argument("--batch-size", type=int, default=None, help="ViT batch (128 / 2)")
    g.add_argument("--img-size", type=int, default=None, help="ViT resolution (224)")
    g.add_argument("--gpt-batch-size", type=int, default=None, help="GPT batch (16 / 2)")
    g.add_argument("--seq-len", type=int, default=None, help="GPT tokens (2048 / 128)")
    g.add_argument("--gpt-depth", type=int, default=None, help="GPT depth (20 / 8): gpt_d{depth}_{k}L")
    g.add_argument("--vocab-size", type=int, default=None, help="GPT vocabulary (65536)")
    g.add_argument("--steps", type=int, default=None, help="timed training steps per model (20 / 3)")
    g.add_argument("--warmup", type=int, default=None, help="untimed training steps per model (5 / 1)")
    g.add_argument("--layer-steps", type=int, default=None, help="timed layer steps (50 / 30)")
    g.add_argument("--layer-warmup", type=int, default=None, help="untimed layer steps (10 / 3)")
    g = p.add_argument_group("GPT activation memory (gpt_memory: bench/gpt_memory.py; bf16 autocast)")
    g.add_argument("--memory-depths", type=int, nargs="+", default=None, help="GPT depths (20 / 4 8)")
    g.add_argument("--nanochat", default=None, metavar="DIR",
                   help="a folder holding karpathy/nanochat's nanochat/ package (eec0c79): its GPT beside ours")
    g.add_argument("--memory-cap-gib", type=float, default=None,
                   help="CUDA: the process may use only this much of the card (79.6: an 80 GB H100)")
    g = p.add_argument_group("loader, tokenizer and analysis (defaults: CUDA / CPU)")
    g.add_argument("--loader-tokens", type=int, default=None, help="tokens on disk (1e8 / 2e7)")
    g.add_argument("--loader-seq-len", type=int, default=None, help="TokenStream window (2048)")
    g.add_argument("--loader-batch", type=int, default=None, help="TokenStream micro batch (32)")
    g.add_argument("--tokenizer-vocab", type=int, default=None, help="BPE vocabulary trained on the help text (4096)")
    g.add_argument("--tokenizer-chars", type=int, default=None, help="characters encoded per thread count (2e7)")
    g.add_argument("--tokenizer-threads", type=int, nargs="+", default=None, help="encode_batch threads (1 2)")
    g.add_argument("--analysis-tokens", type=int, nargs="+", default=None, help="N, one process each (1e5 1e6)")
    g.add_argument("--analysis-dim", type=int, default=None, help="feature dimension D (768)")
    g.add_argument("--analysis-seqs", type=int, default=None, help="sequences (1000)")
    g.add_argument("--analysis-classes", type=int, default=None, help="classes (100)")
    g.add_argument("--analysis-batch", type=int, default=None, help="tokens per update() (4096)")
    g.add_argument("--analysis-matmul-tokens", type=int, default=None,
                   help="tokens of the X^T X reference (all / 1e5: it measures a rate)")
    g = p.add_argument_group("image input paths (images: bench/images.py; defaults CUDA / CPU)")
    g.add_argument("--images-files", type=int, default=None, help="JPEG files written per layout (48)")
    g.add_argument("--images-items", type=int, default=None, help="timed samples per path (300 / 200)")
    g.add_argument("--images-warmup", type=int, default=None, help="untimed samples per path (10)")
    g.add_argument("--images-diff-items", type=int, default=None,
                   help="samples compared, reduced against full-size decode (50)")
    g.add_argument("--images-size", type=int, default=None,
                   help="data.img_size (default: experiment=deit3_in1k_author's, 192)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="folder of the records (default: docs/benchmarks)")
    g.add_argument("--note", default="", help="free text stored in the record (e.g. the machine's load)")
    p.add_argument("--analysis-one", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args(argv)
    try:
        args.device_type = torch.device(args.device).type
    except RuntimeError as e:
        p.exit(2, f"error: --device {args.device}: {str(e).splitlines()[0]}; use cuda, cuda:N or cpu\n")
    if args.device_type == "cuda" and not torch.cuda.is_available():
        p.exit(2, f"error: --device {args.device}: this machine has no CUDA device torch can use; "
                  f"run on a GPU machine or pass --device cpu\n")
    defaults = DEFAULTS["smoke" if args.smoke else args.device_type if args.device_type == "cuda" else "cpu"]
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.warmup = max(args.warmup, 2 if args.compile else 1)  # memory step (+ the compile step)
    args.layer_warmup = max(args.layer_warmup, 2 if args.compile else 1)
    args.modes = ["eager"] + (["compiled"] if args.compile else [])
    return args


def setup(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    use_tf32(torch.device(args.device))  # fp32 runs as on a training cluster


def free(cases, args):
    for c in cases:
        c.free()
    gc.collect()
    if args.device_type == "cuda":
        torch.cuda.empty_cache()


def finite(x):
    """NaN / inf as null: the JSON stays standard."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite(v) for v in x]
    return x


def write_record(record: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem, n = report.record_stem(record), 1
    while (out / f"{stem}.json").exists() or (out / f"{stem}.md").exists():
        n += 1
        stem = f"{report.record_stem(record)}_{n}"
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(finite(record), indent=1) + "\n")
    md.write_text(report.markdown(record))
    return js, md


def main(argv=None) -> dict:
    args = parse_args(argv)
    setup(args)
    if args.analysis_one is not None:  # the child of the analysis section: one JSON line
        print(json.dumps(analysis_one(args.analysis_one, args.analysis_dim, args.analysis_seqs,
                                      args.analysis_classes, args.analysis_batch, args.device,
                                      args.analysis_matmul_tokens)))
        return {}
    # Imported here: the --analysis-one child measures its memory without timm and the models.
    from .models import layer_cases, step_cases
    from .timing import run_group

    t_start = time.perf_counter()
    record = dict(schema=1, date=datetime.now().astimezone().isoformat(timespec="seconds"),
                  command=report.command_line(argv),
                  args={k: v for k, v in vars(args).items() if k != "analysis_one"},
                  machine=report.machine_info(args.device_type), git_commit=report.git_commit(ROOT),
                  note=args.note, cases=[], ratios=[], gpt_memory=None, loader=None, images=None,
                  tokenizer=None, analysis=None)
    record["settings"] = {k: getattr(args, k) for k in ("device", "dtype", "modes", "steps", "warmup",
                                                         "layer_steps", "layer_warmup", "smoke")}
    m = record["machine"]
    print(f"[bench] {args.device} ({m.get('gpu') or m['cpu']}, {m['torch_threads']} threads) "
          f"dtype={args.dtype} modes={','.join(args.modes)} sections={','.join(args.sections)}", flush=True)
    builders = {"layer": (layer_cases, args.layer_warmup, args.layer_steps),
                "step": (step_cases, args.warmup, args.steps)}
    for section in ("layer", "step"):
        if section not in args.sections:
            continue
        build, warmup, steps = builders[section]
        for family in args.families:
            for mode in args.modes:
                t0 = time.perf_counter()
                cases = build(family, mode, args)
                run_group(cases, args.device_type, warmup, steps)
                record["cases"] += [c.record(args.device_type) for c in cases]
                free(cases, args)
                print(f"[{section} {family} {mode}: {time.perf_counter() - t0:.0f} s]", flush=True)
    record["ratios"] = report.ratios(record["cases"], args.device_type)
    if "gpt_memory" in args.sections:
        from . import gpt_memory

        t0 = time.perf_counter()
        record["gpt_memory"] = gpt_memory.run(args)
        print(f"[gpt_memory: {time.perf_counter() - t0:.0f} s]", flush=True)
    if "loader" in args.sections:
        t0 = time.perf_counter()
        record["loader"] = bench_stream(args.loader_tokens, max(1, -(-args.loader_tokens // 4)),
                                        args.loader_seq_len, args.loader_batch)
        print(f"[loader: {time.perf_counter() - t0:.0f} s]", flush=True)
    if "images" in args.sections:
        from . import images

        t0 = time.perf_counter()
        record["images"] = images.run(args)
        print(f"[images: {time.perf_counter() - t0:.0f} s]", flush=True)
    if "tokenizer" in args.sections:
        t0 = time.perf_counter()
        record["tokenizer"] = bench_tokenizer(args.tokenizer_vocab, args.tokenizer_chars, args.tokenizer_threads)
        print(f"[tokenizer: {time.perf_counter() - t0:.0f} s]", flush=True)
    if "analysis" in args.sections:
        record["analysis"] = []
        for N in args.analysis_tokens:
            t0 = time.perf_counter()
            record["analysis"].append(analysis_subprocess(
                N, args.analysis_dim, args.analysis_seqs, args.analysis_classes, args.analysis_batch,
                args.device, args.threads, args.analysis_matmul_tokens))
            print(f"[analysis N={N:,}: {time.perf_counter() - t0:.0f} s]", flush=True)
    record["seconds"] = time.perf_counter() - t_start
    out = Path(args.out) if args.out else Path("docs/benchmarks")
    js, md = write_record(record, out)
    print("\n" + report.markdown(record), flush=True)
    print(f"[bench] {record['seconds']:.0f} s; records: {js} and {md}", flush=True)
    record["files"] = [str(js), str(md)]
    return record
