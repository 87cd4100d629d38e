"""Speed and memory of Laplacian heads, and of our ViT against timm's, in one run.

    .venv/bin/python scripts/benchmark.py                          # CPU defaults, ~2-3 min on 2 cores
    python scripts/benchmark.py --device cuda --gpt-depth 20       # the paper's 561M GPT, bf16
    python scripts/benchmark.py --device cuda --compile --steps 30

Times one training step without an optimizer (zero grads, forward, loss.backward()) for
    ViT-B:  vitb_0L vs vitb_12L (all heads Laplacian) vs timm's deit3_base_patch16_224
    GPT:    gpt_d{depth}_0L vs gpt_d{depth}_{all}L (default depth 12 on CPU, 20 on GPU)
and prints a table plus the ratios the project targets: Laplacian / baseline time at most
1.02 (the head is one subtraction after SDPA), ours / timm time at most 1.00.

Timing: the models of a group are stepped round-robin (the order rotated every round), so
drifts in machine load hit every model alike; the table gives the median and the minimum over
--steps timed steps after --warmup untimed ones. CUDA is synchronised before each timer read.
On CPU the process CPU time is reported too: on a shared host other jobs inflate wall time far
more than CPU time (use --threads 1 there: idle OpenMP threads spin while waiting for a core).
Run-to-run noise of several percent is common on CPU: compare the ratios of two runs.

Memory, measured on the first warm-up step of each model:
    peak MB  - CUDA: torch.cuda.max_memory_allocated during the step minus what was allocated
               before it (weights), i.e. activations + gradients + workspace.
               CPU: increase of the process's resident set size (RSS) during the step, sampled
               every millisecond from /proc/self/statm. Caveat: the CPU allocator keeps freed
               memory (RSS never shrinks back fully) and short spikes between samples are missed,
               so this is a rough, usually low estimate; compare it only between models.
    saved MB - bytes of the tensors autograd saves for backward, deduplicated by storage and
               without the parameters: the activation memory, exact and allocator independent
               (under bf16 autocast it includes the bf16 weight copies; n/a with --compile).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading
import time

import timm
import torch
import torch.nn.functional as F

import laplace
from laplace.gpt import gpt_dims


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="bf16 = bf16 autocast; default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile every model")
    p.add_argument("--groups", nargs="+", choices=["vit", "gpt"], default=["vit", "gpt"])
    p.add_argument("--batch-size", type=int, default=None, help="ViT batch (CPU 4, CUDA 128)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--gpt-batch-size", type=int, default=None, help="GPT batch (CPU 2, CUDA 16)")
    p.add_argument("--seq-len", type=int, default=None, help="GPT tokens (CPU 256, CUDA 2048)")
    p.add_argument("--gpt-depth", type=int, default=None, help="CPU 12, CUDA 20")
    p.add_argument("--steps", type=int, default=None, help="timed steps (CPU 3, CUDA 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (CPU 1, CUDA 5)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    defaults = dict(dtype="bf16" if cuda else "fp32", batch_size=128 if cuda else 4,
                    gpt_batch_size=16 if cuda else 2, seq_len=2048 if cuda else 256,
                    gpt_depth=20 if cuda else 12, steps=20 if cuda else 3, warmup=5 if cuda else 1)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.compile:
        args.warmup = max(args.warmup, 2)  # the first call compiles
    args.warmup = max(args.warmup, 1)  # memory is measured on the first warm-up step
    return args


class RSSSampler:
    """Peak resident set size during a `with` block, sampled from /proc/self/statm (Linux)."""

    def __init__(self, interval: float = 1e-3):
        self.interval, self.page = interval, os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self):
        self.start = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        self.increase = self.peak - self.start


class SavedBytes:
    """Bytes autograd saves for backward inside a `with` block, each storage counted once and
    the model's parameters (which linear layers save too) left out: the activation memory."""

    def __init__(self, model: torch.nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def __enter__(self):
        self.storages = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in self.skip:
                self.storages[s.data_ptr()] = s.nbytes()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.bytes = sum(self.storages.values())


class Case:
    """One model with its fixed random batch and a train-step closure."""

    def __init__(self, name, shape, model, batch, loss_fn):
        self.name, self.shape, self.model, self.batch, self.loss_fn = name, shape, model, batch, loss_fn
        self.times, self.cpu_times, self.peak, self.saved = [], [], float("nan"), float("nan")

    def step(self, args):
        self.model.zero_grad(set_to_none=True)  # grads are re-allocated, as in training
        with torch.autocast(args.device_type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = self.loss_fn(self.model, *self.batch)
        loss.backward()


def sync(args):
    if args.device_type == "cuda":
        torch.cuda.synchronize()


def vit_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def gpt_loss(model, idx, targets):
    return model(idx, targets=targets)


def build_cases(group, args) -> list[Case]:
    dev = args.device
    torch.manual_seed(0)
    if group == "vit":
        B, S = args.batch_size, args.img_size
        batch = (torch.randn(B, 3, S, S, device=dev), torch.randint(0, 1000, (B,), device=dev))
        shape = f"B={B} {S}px"
        models = {"vitb_0L": laplace.create_model("vitb_0L", img_size=S),
                  "vitb_12L": laplace.create_model("vitb_12L", img_size=S),
                  "timm deit3_base": timm.create_model("deit3_base_patch16_224", pretrained=False,
                                                       img_size=S)}
        loss_fn = vit_loss
    else:
        B, T, D = args.gpt_batch_size, args.seq_len, args.gpt_depth
        heads = gpt_dims(D)[1]  # k = all heads
        idx = torch.randint(0, 65536, (B, T + 1), device=dev)
        batch = (idx[:, :-1], idx[:, 1:])
        shape = f"B={B} T={T}"
        models = {f"gpt_d{D}_0L": laplace.create_model(f"gpt_d{D}_0L", max_seq_len=T),
                  f"gpt_d{D}_{heads}L": laplace.create_model(f"gpt_d{D}_{heads}L", max_seq_len=T)}
        loss_fn = gpt_loss
    cases = []
    for name, m in models.items():
        m = m.to(dev).train()
        if args.compile:
            m = torch.compile(m)
        cases.append(Case(name, shape, m, batch, loss_fn))
    return cases


def measure_memory(case: Case, args):
    gc.collect()
    if args.device_type == "cuda":
        sync(args)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    saved = SavedBytes(case.model) if not args.compile else None
    with RSSSampler() as rss:
        if saved is not None:
            with saved:
                case.step(args)
        else:
            case.step(args)
        sync(args)
    if args.device_type == "cuda":
        case.peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        case.peak = rss.increase / 2**20
    case.saved = saved.bytes / 2**20 if saved is not None else float("nan")


def run_group(cases: list[Case], args):
    for c in cases:  # first warm-up step: memory (hooks and sampler would perturb the timings)
        measure_memory(c, args)
    for r in range(args.warmup - 1 + args.steps):
        order = cases[r % len(cases):] + cases[:r % len(cases)]  # rotate: no fixed position
        for c in order:
            sync(args)
            t0, c0 = time.perf_counter(), time.process_time()
            c.step(args)
            sync(args)
            if r >= args.warmup - 1:
                c.times.append(time.perf_counter() - t0)
                c.cpu_times.append(time.process_time() - c0)


def ratio_line(label, num: Case, den: Case, target: float, cpu: bool) -> str:
    """Median/median wall-time ratio (the verdict), min/min, and on CPU the process-CPU-time
    ratio, which other jobs on a shared host disturb less than wall time."""
    r = statistics.median(num.times) / statistics.median(den.times)
    line = f"  {label:<32} {r:6.3f}   min/min {min(num.times) / min(den.times):6.3f}"
    if cpu:
        line += f"   cpu {statistics.median(num.cpu_times) / statistics.median(den.cpu_times):6.3f}"
    return line + f"   target <= {target:.2f}: {'met' if r <= target else 'NOT met'}"


def main():
    args = parse_args()
    args.device_type = torch.device(args.device).type
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 runs as on a training cluster
        torch.backends.cudnn.allow_tf32 = True
    desc = (f"device={args.device} ({torch.cuda.get_device_name() if args.device_type == 'cuda' else f'{torch.get_num_threads()} threads'}) "
            f"dtype={args.dtype} compile={args.compile} warmup={args.warmup} steps={args.steps} "
            f"torch={torch.__version__} timm={timm.__version__}")
    print(desc, flush=True)
    results: dict[str, list[Case]] = {}
    for group in args.groups:
        t0 = time.perf_counter()
        cases = build_cases(group, args)
        run_group(cases, args)
        results[group] = cases
        print(f"[{group} done in {time.perf_counter() - t0:.0f} s]", flush=True)
        for c in cases:  # free the group before building the next one
            c.model = None
        gc.collect()
        if args.device_type == "cuda":
            torch.cuda.empty_cache()

    cpu = args.device_type == "cpu"
    peak_label = "RSS+ MB" if cpu else "peak MB"
    head = (f"{'model':<18} {'batch':<14} {'median ms':>10} {'min ms':>10} {'spread':>7} "
            + (f"{'cpu ms':>10} " if cpu else "") + f"{peak_label:>9} {'saved MB':>9}")
    print("\n" + head + "\n" + "-" * len(head))
    for cases in results.values():
        for c in cases:
            med, lo = statistics.median(c.times), min(c.times)
            spread = (max(c.times) - lo) / med  # (max - min) / median over the timed steps
            cpu_ms = f"{1e3 * statistics.median(c.cpu_times):10.1f} " if cpu else ""
            print(f"{c.name:<18} {c.shape:<14} {1e3 * med:10.1f} {1e3 * lo:10.1f} {spread:7.1%} "
                  f"{cpu_ms}{c.peak:9.0f} {c.saved:9.1f}")
    print("\nstep-time ratios (median/median wall time):")
    if "vit" in results:
        base, lap, ref = results["vit"]
        print(ratio_line(f"{lap.name} / {base.name}", lap, base, 1.02, cpu))
        print(ratio_line(f"{base.name} / {ref.name}", base, ref, 1.00, cpu))
    if "gpt" in results:
        base, lap = results["gpt"]
        print(ratio_line(f"{lap.name} / {base.name}", lap, base, 1.02, cpu))

if __name__ == "__main__":
    main()
