"""What only a GPU shows, checked in one command on one GPU node (run by scripts/gpu_check.sh).

    bash scripts/gpu_check.sh                                    # CUDA: bf16, compiled where configured
    bash scripts/gpu_check.sh --device cpu --no-compile --tiny   # a dry run of the script on CPU
    bash scripts/gpu_check.sh --only deit3 analysis              # some of the checks (CHECKS)

Each check runs what a user runs (train.py with data workers, the evaluations, analysis, pytest -m
cuda) at small size and prints one line: PASS / SKIP / FAIL, seconds, what it measured, the largest
CUDA peak of its train.py runs and the graph breaks and recompiles torch logged (TORCH_LOGS: its
log in --out says where and why). Exit status 1 if any failed. A CUDA run appends its results to
docs/gpu_runs.jsonl and rewrites docs/gpu_runs.md, the last run of each check (a CPU run: --record).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout (train) and tests/ (fakedata)
import fakedata  # noqa: E402  (tests/: tiny datasets in the real on-disk formats)
from train.logger import git_commit, logged  # noqa: E402

PY = sys.executable
# train.py run in this process after an optional memory cap (an 80 GB card's on a bigger card);
# at exit it prints the CUDA peak (DataLoader workers leave by os._exit and print nothing). runpy
# rather than a child process: the cap and the peak must be those of the process that trains.
RUN = """import atexit, os, runpy, sys, torch
if os.environ.get("CAP_GIB") and torch.cuda.is_available():
    torch.cuda.set_per_process_memory_fraction(
        float(os.environ["CAP_GIB"]) * 2**30 / torch.cuda.get_device_properties(0).total_memory)
atexit.register(lambda: torch.cuda.is_initialized() and print(
    f"CUDA peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")"""
PEAK = re.compile(r"^CUDA peak ([\d.]+) GiB", re.M)
BREAK, RECOMPILE = "[__graph_breaks] Graph break", "[__recompiles] Recompiling"  # torch's log lines


class Check:
    """Runs the checks' commands, each logged to <out>/<check>.log under a timeout."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
        self.runs, self.data, self.cuda = self.out / "runs", self.out / "data", args.device.startswith("cuda")
        # torch logs every graph break and recompile with its reason: counted per check, kept in its log.
        # PYTHONPATH: this checkout (also without an install) and tests/ (tests/ddp_ranks.py's imports).
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_LOGS="graph_breaks,recompiles",
                        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
        # Each config compiles as shipped (the paper's experiments: trainer.compile=auto, on with CUDA).
        self.common = [f"trainer.device={args.device}", "trainer.progress=false", "trainer.log_every=1",
                       f"paths.runs_dir={self.runs}", *([] if args.compile else ["trainer.compile=false"])]
        # Small models: the checks are about the code paths, not the sizes (d20 and throughput aside).
        self.vit = ["model=vitb_12L", *(["model.depth=1", "model.embed_dim=96"] if args.tiny else ["model.depth=2"])]
        self.gpt, self.workers = ("gpt_d2_1L", 2) if args.tiny else ("gpt_d12_6L", 8)
        self.log, self.results = self.out / "none.log", {}

    def sh(self, *cmd, expect: int | None = 0, timeout: int = 600, popen: bool = False, **env):
        """Run cmd, its output appended to the check's log; a status other than `expect` raises.
        popen: start it and return its Popen (a check that signals its command)."""
        with open(self.log, "a") as log:
            print("$", *cmd, file=log, flush=True)  # before the command's own output
            kw = dict(cwd=ROOT, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT)
            if popen:
                return subprocess.Popen(list(map(str, cmd)), **kw)
            try:  # run kills a command past its timeout: it fails its check, not the whole script
                done = subprocess.run(list(map(str, cmd)), timeout=timeout, **kw)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"timed out after {timeout} s ({self.log})") from None
        if expect is not None and done.returncode != expect:
            # The log's last line: the error a command ended with, or pytest's summary.
            raise RuntimeError(f"exit status {done.returncode}, expected {expect}: {self.tail()} ({self.log})")
        return done

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self) -> str:
        return next((ln[-300:] for ln in reversed(self.text().splitlines()) if ln.strip()), "")

    def train(self, run: str, *overrides, **kw):
        """train.py (through RUN) into <out>/runs/<run>."""
        return self.sh(PY, "-c", RUN, "train.py", *overrides, *self.common, f"run_dir={self.runs / run}", **kw)

    def ckpt(self, run: str) -> Path:
        return self.runs / run / "ckpt/last.pt"

    def run(self, name: str, fn) -> None:
        """One check: its line, and (unless skipped) its result for the record."""
        t0, self.log = time.time(), self.out / f"{name}.log"
        try:
            status, what = "PASS", fn(self)
        except Exception as e:  # a failed check is reported, the others still run
            status, what = "FAIL", f"{type(e).__name__}: {e}"
            with open(self.log, "a") as log:
                traceback.print_exc(file=log)
        if what.startswith("SKIP: "):  # nothing measured, nothing recorded
            return print(f"SKIP {name:<14}{time.time() - t0:5.0f} s  {what[6:]}", flush=True)
        # What its commands used, over all of them: RUN's peak lines and torch's log lines.
        text, peak = self.text(), max(map(float, PEAK.findall(self.text())), default=None)
        used = (f"peak {peak:.1f} GiB, " if peak else "") + f"{text.count(BREAK)} graph breaks, " \
            f"{text.count(RECOMPILE)} recompiles"
        print(f"{status} {name:<14}{time.time() - t0:5.0f} s  {what} [{used}]", flush=True)
        self.results[name] = {"result": status, "measured": what, "used": used}


def metrics(run_dir: Path, split: str = "train") -> pd.DataFrame:
    """A run's metrics.jsonl records of one split."""
    return pd.DataFrame(logged(run_dir, split))


def logged_once(run_dir: Path, steps: int):
    """Raise unless the run logged steps 1..`steps` once each (a resume repeats none, skips none)."""
    if (logged := metrics(run_dir).step.tolist()) != list(range(1, steps + 1)):
        raise RuntimeError(f"expected steps 1..{steps} in {run_dir}/metrics.jsonl, got {logged}")


def bpe(c: Check, source: str, vocab: int) -> Path:
    """Token shards of a built-in text (python prepare.py), once per --out."""
    out = c.data / f"{source}_bpe_{vocab}"  # shared: the tiny experiments serve three checks
    if not (out / "meta.json").exists():
        c.sh(PY, "prepare.py", f"source={source}", f"vocab_size={vocab}", f"out={out}", "progress=false", timeout=900)
    return out


def stop_and_resume(c: Check, run: str, overrides: list[str], steps: int, batch: int) -> str:
    """`steps` steps in two invocations (stopped at half, then resumed); the resume is checked."""
    over = [*overrides, f"trainer.max_steps={steps}", f"trainer.global_batch_size={batch}"]
    c.train(run, *over, f"trainer.stop_after={steps // 2}")
    c.train(run, *over)  # the same run folder: it resumes from last.pt
    if f"resumed at step {steps // 2}" not in c.text():
        raise RuntimeError(f"the second invocation did not resume at step {steps // 2}")
    logged_once(c.runs / run, steps)
    val = metrics(c.runs / run, "val").tail(1).filter(like="val_").dropna(axis=1)  # none: the run logs no eval
    got = "".join(f"{k}={v:.3f}, " for k, v in val.iloc[0].items()) if len(val) else ""
    # The median step time after compilation and warm-up (the first two steps).
    return f"stop@{steps // 2} + resume -> {steps}; {got}{metrics(c.runs / run).step_ms[2:].median():.0f} ms/step"


def tiny(c: Check) -> dict[str, list[str]]:
    """The paper's experiments shrunk to seconds and made deterministic (no drop-path, Mixup or
    CutMix), so that eager and compiled runs, or 1 and 2 processes, compare step by step."""
    # The paper's per-GPU micro batches are larger than these global batches: micro_batch_size=null.
    images = [f"data.root={c.data / 'imagenet'}", "data.img_size=64", "model.drop_path_rate=0.0",
              "trainer.global_batch_size=16", "trainer.num_workers=2", "trainer.max_steps=4"]
    return {"deit3_in1k_author": ["experiment=deit3_in1k_author", "model=vitb_12L", "model.depth=2", *images,
                                  "trainer.micro_batch_size=null", "trainer.mixup=0.0", "trainer.cutmix=0.0",
                                  "trainer.eval_every=100"],
            "gpt_d20": ["experiment=gpt_d20", "model=gpt_d2_1L", f"data.root={bpe(c, 'pydoc', 512)}",
                        "data.vocab_size=512", "data.seq_len=128", "data.val_tokens=8192",
                        "trainer.global_batch_size=8", "trainer.max_steps=4", "trainer.micro_batch_size=null",
                        "trainer.sample_prompts=[]", "trainer.eval_every=100"],
            "dino_in1k": ["experiment=dino_in1k", "model=vits_5L", "model.depth=1", "model.embed_dim=96", *images,
                          "trainer.multicrop.local_size=32", "trainer.multicrop.local_crops=2",
                          "trainer.head.out_dim=256"]}


def same_losses(c: Check, pairs: dict[str, tuple[Path, Path]]) -> str:
    """The largest relative gap between the logged losses of each pair of runs; raises past rounding."""
    gaps = {}
    for name, (a, b) in pairs.items():
        x, y = metrics(a).loss, metrics(b).loss
        gaps[name] = ((x - y).abs() / x.abs()).max() if len(x) == len(y) else float("inf")
    if max(gaps.values()) > (2e-2 if c.cuda else 1e-4):  # CUDA: bf16 autocast
        raise RuntimeError(f"losses differ: {gaps}")
    return ", ".join(f"{k} {v:.1e}" for k, v in gaps.items())


def compiled(c: Check) -> str:
    """Each tiny paper experiment eager and compiled, side by side: the same losses, no graph break."""
    if not c.args.compile:
        return "SKIP: --no-compile"
    # Side by side: compilation is mostly one core's work. trainer.compile=true is auto's choice on CUDA.
    jobs = [(f"{name}_{mode}", *over, f"trainer.compile={str(mode == 'compiled').lower()}")
            for name, over in tiny(c).items() for mode in ("eager", "compiled")]
    with ThreadPoolExecutor(len(jobs)) as pool:  # one thread per run, waiting on its process
        list(pool.map(lambda job: c.train(*job, timeout=900), jobs))  # list(): the first failure raises
    if BREAK in c.text():
        raise RuntimeError(f"graph breaks in the compiled runs ({c.log})")
    pairs = {name: (c.runs / f"{name}_eager", c.runs / f"{name}_compiled") for name in tiny(c)}
    return "largest relative loss gap eager vs compiled: " + same_losses(c, pairs)


def ranks(c: Check) -> str:
    """torchrun of 2 processes (NCCL; gloo on the CPU) over the tiny experiments, stopped half-way and
    resumed (tests/ddp_ranks.py): every parameter and buffer of the whole trained module bitwise the
    same on both ranks after set-up, the stop, the resume and the end; the losses of 1 process."""
    if c.cuda and torch.cuda.device_count() < 2:
        return f"SKIP: {torch.cuda.device_count()} GPU on this node (a node with 2+ runs 2 ranks)"
    out = c.runs / "ranks"
    # One line per run (label, config, overrides); ddp_ranks.py resumes each after its stop itself.
    lines = "\n".join(" ".join([name, "config", *over, *c.common, "trainer.stop_after=2"])
                      for name, over in tiny(c).items())
    c.sh(PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", ROOT / "tests/ddp_ranks.py",
         out, lines, timeout=900)
    if differ := differing(json.loads(out.read_text())):
        raise RuntimeError(f"the ranks' tensors differ: {differ}")
    for name, over in tiny(c).items():  # the same global batch on one process
        c.train(f"{name}_one", *over)
    gaps = same_losses(c, {name: (c.runs / f"{name}_one", Path(f"{out}.{name}")) for name in tiny(c)})
    return f"2 ranks hold one model after set-up, stop, resume and end; loss gap to 1 process: {gaps}"


def differing(result: dict) -> list[str]:
    """'<run> <phase>: <tensors>' wherever a rank's tensors are not rank 0's (tests/ddp_ranks.py's
    result: run -> phases -> one fingerprint {tensor: sha1 of its bytes} per rank)."""
    out = []
    for name, res in result.items():
        for phase, prints in res["phases"].items():
            # One row per rank, one column per tensor: a tensor only one rank holds differs too (NaN).
            df = pd.DataFrame(prints)
            if bad := sorted(df.columns[df.ne(df.iloc[0]).any()]):
                out.append(f"{name} {phase}: {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}")
    return out


def preemption(c: Check) -> str:
    """SIGUSR1 part-way: last.pt and the requeue status 75, then the same command finishes the run."""
    over = ["experiment=gpt_pydoc", f"model={c.gpt}", "trainer.max_steps=60", "trainer.eval_every=1000",
            "trainer.ckpt_every=1000", "trainer.num_workers=2"]
    proc, t0, log = c.train("preempt", *over, popen=True), time.time(), c.runs / "preempt/metrics.jsonl"
    try:  # signalled once 3 steps are logged: inside the loop, past set-up and compilation
        while not log.exists() or log.read_text().count("\n") < 3:
            if proc.poll() is not None or time.time() - t0 > 300:
                raise RuntimeError(f"no step 3 logged (status {proc.poll()})")
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=600)
    finally:
        proc.kill()  # a no-op once it has ended
    if proc.returncode != 75:  # train.signals.EXIT_REQUEUE
        raise RuntimeError(f"exit status {proc.returncode} after SIGUSR1, expected 75: {c.tail()} ({c.log})")
    stopped = torch.load(c.ckpt("preempt"), map_location="cpu", weights_only=True)["loop"]["step"]
    c.train("preempt", *over)  # what a requeued job runs: the same command
    logged_once(c.runs / "preempt", 60)
    return f"signal at step ~3 -> saved step {stopped}, status 75; the same command finished 60 steps"


def d20(c: Check) -> str:
    """experiment=gpt_d20 as the paper runs it (micro batch 32 x 2048 tokens, 65,536-token BPE, bf16,
    compiled) for 3 steps in an 80 GB card's 79.6 GiB, without and with model.grad_checkpointing:
    CUDA peak, tokens/s, MFU. One GPU: DDP's gradient buckets (~2.2 GB more) are not in it."""
    vocab, size = (1024, ["model=gpt_d2_1L", "data.seq_len=128", "trainer.global_batch_size=8",
                          "trainer.micro_batch_size=4"]) if c.args.tiny else (65536, ["model=gpt_d20_5L"])
    out = []
    for gc in ("false", "true"):
        # CAP_GIB: RUN caps the process at what an 80 GB card's allocator can hand out.
        start = len(c.text())
        done = c.train(f"d20_gc_{gc}", "experiment=gpt_d20", *size, f"data.root={bpe(c, 'stdlib', vocab)}",
                       f"data.vocab_size={vocab}", "data.val_tokens=524288", "trainer.max_steps=3",
                       f"model.grad_checkpointing={gc}", expect=None, timeout=1200, CAP_GIB="79.6")
        text = c.text()[start:]  # this run's part of the log
        if "OutOfMemoryError" in text:
            out.append(f"grad_checkpointing={gc}: out of memory")
            continue
        if done.returncode:  # any other failure
            raise RuntimeError(f"exit status {done.returncode}: {c.tail()} ({c.log})")
        m, peak = metrics(c.runs / f"d20_gc_{gc}").iloc[-1], PEAK.findall(text)  # the last step: warm
        out.append(f"grad_checkpointing={gc}: peak {peak[-1] + ' GiB' if peak else 'n/a (no CUDA)'}, "
                   f"{m.tok_per_s:,.0f} tokens/s, MFU {m.get('mfu', float('nan')):.1%}")
    if out[0].endswith("out of memory"):  # the shipped setting must fit
        raise RuntimeError("; ".join(out) + ": set model.grad_checkpointing=true or trainer.micro_batch_size=16")
    return "; ".join(out)


def throughput(c: Check, experiment: str, *extra: str) -> str:
    """Ten steps of `experiment` per GPU as the paper runs it (bf16, compiled as shipped), then the
    same feed into a 1-block model, whose step costs next to nothing: its images/s is the data
    loader's (8 workers). A loader slower than the real step bounds the run."""
    folder = c.data / "imagenet_320px"  # ImageNet-sized JPEGs; 1,024: ten steps within an epoch
    if not folder.exists():
        fakedata.write_imagenet_folder(folder, n_classes=4, per_class=16 if c.args.tiny else 256,
                                       size=64 if c.args.tiny else 320)
    dino = experiment == "dino_in1k"
    over = [f"experiment={experiment}", f"data.root={folder}", "trainer.max_steps=10", "trainer.eval_every=1000",
            "model=vits_5L" if dino else "model=vitb_12L", *extra]
    if c.args.tiny:
        over += ["model.embed_dim=96", "data.img_size=64", "trainer.global_batch_size=16", "trainer.num_workers=2",
                 "trainer.multicrop.local_size=32" if dino else "trainer.micro_batch_size=null"]
    else:  # per GPU as the paper runs them: DINO 64, DeiT-III 256
        over += [f"trainer.global_batch_size={64 if dino else 256}", "trainer.num_workers=8"]
    rates = {}
    # The loader run keeps the feed (crops, workers, batch) and shrinks the model, and DINO's head.
    for run, model in (("model", []), ("loader", ["model.depth=1", *(["trainer.head.out_dim=1024"] if dino else [])])):
        c.train(f"{c.log.stem}_{run}", *over, *model, timeout=900)
        rates[run] = metrics(c.runs / f"{c.log.stem}_{run}")[2:]  # after compilation and warm-up
    gpu, loader = (rates[r].img_per_s.median() for r in ("model", "loader"))
    # Within 10% of the step's rate, the loader is what bounds the run.
    return (f"{gpu:,.0f} img/s training ({rates['model'].step_ms.median():.0f} ms/step), {loader:,.0f} img/s "
            f"into a 1-block model ({'loader-bound' if loader < 1.1 * gpu else 'the step bounds it'})")


def deit3(c: Check) -> str:
    """DeiT-III on ImageNet's folder layout, then fine-tuning at another size from its checkpoint."""
    imagenet = [*c.vit, f"trainer.num_workers={c.workers}", f"data.root={c.data / 'imagenet'}", "trainer.eval_every=2"]
    line = stop_and_resume(c, "deit3_in1k", ["experiment=deit3_in1k", *imagenet, "data.img_size=64"], 6, 32)
    c.train("deit3_ft", "experiment=deit3_in1k_ft224", *imagenet, "data.img_size=80", "trainer.max_steps=2",
            "trainer.global_batch_size=32", f"trainer.init_from={c.ckpt('deit3_in1k')}")
    return line + "; fine-tuned at 80 px from its checkpoint"


def gpt(c: Check) -> str:
    """Built-in text -> BPE and token shards -> Muon pre-training -> chat SFT -> a sampled reply."""
    line = stop_and_resume(c, "gpt_tiny", ["experiment=gpt_tiny", f"model={c.gpt}", "trainer.eval_every=3",
                                           f"data.root={bpe(c, 'pydoc', 4096)}"], 6, 16)
    c.train("gpt_sft", "experiment=gpt_tiny_sft", f"model={c.gpt}", "trainer.max_steps=3",
            f"trainer.init_from={c.ckpt('gpt_tiny')}")
    c.sh(PY, "-m", "eval.generate", f"checkpoint={c.ckpt('gpt_sft')}", f"device={c.args.device}", "chat=true",
         "prompt=What is a class", "max_new_tokens=16")
    return f"pre-training {line}; SFT 3 steps; eval.generate sampled a chat reply"


def evals(c: Check) -> str:
    """The DINO checkpoint's evaluations."""
    dino, dev = f"checkpoint={c.ckpt('dino_digits')}", f"device={c.args.device}"
    c.sh(PY, "-m", "eval.knn", dino, dev)
    c.sh(PY, "-m", "eval.linear", dino, dev, "epochs=2", "lr_grid=[0.001,0.01]")
    c.sh(PY, "-m", "eval.segmentation", dino, "eval=seg_digits_linear", "iters=4", "trainer.eval_every=4",
         f"trainer.device={c.args.device}", "trainer.progress=false", f"trainer.compile={str(c.args.compile).lower()}",
         f"paths.data_dir={c.data}")
    return "eval.knn, eval.linear, eval.segmentation (4 iterations) on the digits"


def lm_eval(c: Check) -> str:
    c.sh(PY, "-m", "eval.lm", f"checkpoint={c.ckpt('gpt_sft')}", f"device={c.args.device}", "tasks=[laplace_pydoc]",
         "limit=8", "batch_size=4", "bootstrap_iters=0")
    return "eval.lm (lm-eval) of the SFT checkpoint on the laplace_pydoc tasks"


def analysis(c: Check) -> str:
    for run, extra in (("deit3_in1k", ["pca_maps=4"]), ("gpt_tiny", [])):
        c.sh(PY, "-m", "analysis", f"checkpoint={c.ckpt(run)}", f"device={c.args.device}", "max_tokens=20000",
             "progress=false", *extra)
    return "python -m analysis of the deit3_in1k and gpt_tiny checkpoints"


def tests(c: Check) -> str:  # SDPA's flash kernel, forced, is one of them
    c.sh(PY, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", LAPLACE_TEST_DEVICE=c.args.device)
    return f"pytest -m cuda: {c.tail()}"


CHECKS = {  # in this order: the evaluations and analysis read the checkpoints of the runs before them
    "tests": tests, "compile": compiled, "ranks": ranks, "deit3": deit3, "gpt": gpt, "lm_eval": lm_eval,
    "preempt": preemption, "dino": lambda c: stop_and_resume(c, "dino_digits", [
        "experiment=dino_digits", "model=vits_5L", "trainer.num_workers=2"], 6, 64),
    "evals": evals, "analysis": analysis, "d20": d20,
    "dino_in1k": lambda c: throughput(c, "dino_in1k"), "deit3_author": lambda c: throughput(c, "deit3_in1k_author"),
    # The crops and colour work on the GPU (opt-in): the step then includes their GPU time.
    "dino_gpu_crops": lambda c: throughput(c, "dino_in1k", "trainer.multicrop.device_augment=true"),
    "deit3_gpu_crops": lambda c: throughput(c, "deit3_in1k", "data.device_augment=true"),
}


def record(c: Check, path: Path) -> None:
    """Append this run's results to `path` (JSON lines); write the last run of each check to <path>.md."""
    run = {"date": pd.Timestamp.now("UTC").strftime("%Y-%m-%d %H:%M UTC"),
           "gpu": torch.cuda.get_device_name(c.args.device) if c.cuda else f"{c.args.device} (dry run)",
           "commit": git_commit() or "unknown", "torch": torch.__version__,
           "command": " ".join(["bash scripts/gpu_check.sh", *sys.argv[1:]])}
    with open(path, "a") as f:
        f.writelines(json.dumps({"check": name, **res, **run}) + "\n" for name, res in c.results.items())
    rows = pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    last = rows.groupby("check", sort=False).last().reset_index()
    last = last.apply(lambda col: col.astype(str).str.replace("|", "\\|"))  # a pipe would split its cell
    path.with_suffix(".md").write_text(f"# GPU runs\n\nThe last run of each check of `bash scripts/gpu_check.sh`, "
                                       f"written by it (every run: {path.name}).\n\n{last.to_markdown(index=False)}\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--tiny", action="store_true", help="the smallest sizes (a CPU dry run)")
    p.add_argument("--out", help="folder for logs and runs (default: a temporary folder)")
    p.add_argument("--only", nargs="*", choices=CHECKS, help="run only these checks")
    p.add_argument("--record", help="JSON-lines file of results (default: docs/gpu_runs.jsonl, on CUDA only)")
    args = p.parse_args()
    c = Check(args)
    # ImageNet's folder layout with real JPEGs (4 classes): the image runs read it like the real one.
    fakedata.write_imagenet_folder(c.data / "imagenet", n_classes=4, per_class=16)
    print(f"[gpu_check] torch {torch.__version__}, {args.device}{' ' + torch.cuda.get_device_name() if c.cuda else ''}"
          f", compile={args.compile}, out={c.out}", flush=True)
    for name, fn in CHECKS.items():
        if args.only is None or name in args.only:
            c.run(name, fn)
    failed = [n for n, r in c.results.items() if r["result"] == "FAIL"]
    # A dry run must not look like a GPU run in docs/: only CUDA records by default.
    if path := args.record or (ROOT / "docs" / "gpu_runs.jsonl" if c.cuda else None):
        record(c, Path(path))
        print(f"[gpu_check] results appended to {path}; the last run of each check: {Path(path).with_suffix('.md')}")
    print(f"[gpu_check] {len(c.results) - len(failed)}/{len(c.results)} passed" +
          (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
