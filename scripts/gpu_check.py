"""What only a GPU shows, checked in one command on one GPU node (scripts/gpu_check.sh).

    bash scripts/gpu_check.sh                          # CUDA: bf16, compiled where a config says so
    bash scripts/gpu_check.sh --device cpu --no-compile --tiny   # dry run of the script itself

Every trainer and experiment family trains a few steps at small size as a user runs it
(`python train.py ...`, data workers on, compiled as shipped: the paper's experiments with
CUDA, the quick starts eager), stops part-way and resumes; fine-tuning starts
from a CUDA checkpoint; a run signalled with SIGUSR1 checkpoints, exits with the requeue
status and resumes; a bug inside train_step exits non-zero within seconds; `python -m
analysis` measures CUDA checkpoints; eval.knn, eval.linear and eval.segmentation evaluate
the DINO checkpoint and eval.lm (lm-eval) the SFT one; the tests marked `cuda` run on the device
(the flash-kernel one as a check of its own); the benchmark (`python -m bench`) writes its record
to <out>/benchmarks; the GPT's paper-size steps report tokens/s (MFU). What a cluster job depends
on (scripts/gpu_cluster.py): the paper experiments eager = compiled, one model on 2 NCCL ranks
and one GPU's losses (on a node with 2+ GPUs), DINO's and DeiT-III's paper-size steps with their
loader's images/s at 8 workers beside (as shipped, and with the crops and colour work on the GPU:
trainer.multicrop.device_augment, data.device_augment). One line per check (PASS / SKIP / FAIL, seconds, what it measured,
and what its processes used: peak GPU memory, graphs, graph breaks, recompiles, recorded by
scripts/gpu_probe.py around every command); the exit status is 1 if any check failed. Logs of every command
go to --out (default: a fresh temporary folder), named after the check. After a CUDA run the
rows of the checks that ran in README's "What has run on a GPU" are rewritten (scripts/gpu_table.py);
a CPU run writes no README (--table FILE: that file instead).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # fakedata: tiny datasets in the real on-disk formats
sys.path.insert(0, str(ROOT))
import gpu_cluster  # noqa: E402  (beside this file)
import gpu_probe  # noqa: E402
import gpu_table  # noqa: E402

PROBE = ROOT / "scripts" / "gpu_probe.py"

from laplace.io import atomic_write  # noqa: E402


class Check:
    """Runs the commands of the checks, with logs and timeouts, in one output folder. Every Python
    command runs through scripts/gpu_probe.py: each check's line ends with its peak GPU memory,
    compiled graphs, graph breaks and recompiles (the log says which and why)."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts"),
                                                                 os.environ.get("PYTHONPATH", "")]),
                        PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
        # Each config compiles as shipped (the paper's experiments: trainer.compile=auto, on with
        # CUDA); --no-compile turns it off everywhere.
        self.common = [f"trainer.device={args.device}", *([] if args.compile else ["trainer.compile=false"]),
                       "trainer.progress=false", "trainer.log_every=1", f"paths.runs_dir={self.out / 'runs'}"]
        self.failed, self.check, self.pending = [], "none", []

    def probe(self) -> tuple[str, dict]:
        """(line, totals) of the probe records of the current check (scripts/gpu_probe.py)."""
        return gpu_probe.summary(self.out / "probe" / self.check)

    def sh(self, name: str, cmd: list[str], expect: int | None = 0, timeout: int = 300, env=None,
           wait=True) -> subprocess.CompletedProcess | subprocess.Popen:
        """Run cmd (logged to <out>/<name>.log); a status other than `expect` raises. wait=False:
        started and left to `wait_all`."""
        if cmd[0] == sys.executable and cmd[1:3] != ["-m", "torch.distributed.run"]:
            cmd = [sys.executable, str(PROBE), *cmd[1:]]
        log = open(self.out / f"{name}.log", "a")
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        env = dict(env or self.env, GPU_PROBE_DIR=str(self.out / "probe" / self.check))
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        proc.log, proc.expect = Path(log.name), expect
        if not wait:
            self.pending.append(proc)
            return proc
        return self._wait(proc, timeout)

    def _wait(self, proc, timeout: int):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError(f"timed out after {timeout} s (log: {proc.log})") from None
        if proc.expect is not None and proc.returncode != proc.expect:
            raise RuntimeError(f"exit status {proc.returncode}, expected {proc.expect}: "
                               f"{tail(proc.log)} (log: {proc.log})")
        return proc

    def wait_all(self, timeout: int = 600):
        """Wait for every command started with wait=False (they ran side by side)."""
        pending, self.pending = self.pending, []
        t0 = time.time()
        for proc in pending:
            self._wait(proc, max(1, int(timeout - (time.time() - t0))))

    def train(self, name: str, args: list[str], **kw):
        return self.sh(name, [sys.executable, "train.py", *args, *self.common], **kw)

    def torchrun(self, name: str, n: int, script: Path, args: list[str], **kw):
        """`script args` on n processes of this node, each through the probe."""
        return self.sh(name, [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                              str(PROBE), str(script), *args], **kw)

    def run(self, name: str, fn):
        """One check: PASS / SKIP / FAIL, seconds, what it measured and what its processes used."""
        t0, self.check = time.time(), re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        try:
            what = fn()
            used = self.probe()[0]
            skip = isinstance(what, str) and what.startswith("SKIP")
            print(f"{'SKIP' if skip else 'PASS'} {name:<34} {time.time() - t0:6.1f} s  "
                  f"{what[6:] if skip else what}" + ("" if skip else f" [{used}]"), flush=True)
            return None if skip else True
        except Exception as e:  # a failed check is reported, the others still run
            self.failed.append(name)
            print(f"FAIL {name:<34} {time.time() - t0:6.1f} s  {type(e).__name__}: {e}", flush=True)
            with open(self.out / f"{name}.log", "a") as log:
                traceback.print_exc(file=log)
            return False
        finally:
            for proc in self.pending:  # a check that raised leaves none running
                proc.kill()
            self.pending = []


def tail(path: Path, n: int = 1) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-300:]


def records(run_dir: Path, split: str = "train") -> list[dict]:
    from train.logger import logged

    return logged(run_dir, split)


def step_ms(run_dir: Path) -> str:
    """Median step time of the logged steps after the first two (compilation, warm-up)."""
    times = [r["step_ms"] for r in records(run_dir)[2:]]
    return f"{statistics.median(times):.1f} ms/step" if times else "n/a ms/step"


def stop_and_resume(c: Check, name: str, args: list[str], steps: int, batch: int) -> str:
    """Train `steps` steps in two invocations (stop at half, resume); check the resume."""
    run_dir = c.out / "runs" / name
    args = [*args, f"run_dir={run_dir}", f"trainer.max_steps={steps}", f"trainer.global_batch_size={batch}"]
    c.train(name, [*args, f"trainer.stop_after={steps // 2}"])
    c.train(name, args)
    if f"resumed at step {steps // 2}" not in (c.out / f"{name}.log").read_text():
        raise RuntimeError(f"the second invocation did not resume at step {steps // 2}")
    logged = [r["step"] for r in records(run_dir)]
    if logged != list(range(1, steps + 1)):
        raise RuntimeError(f"expected steps 1..{steps} in metrics.jsonl, got {logged}")
    val = records(run_dir, "val")
    metric = ", ".join(f"{k}={v:.3f}" for k, v in val[-1].items() if k.startswith("val_")) if val else "no eval"
    return f"stop@{steps // 2} + resume -> {steps}; {metric}; {step_ms(run_dir)}"


def preemption(c: Check, gpt: str) -> str:
    """SIGUSR1 part-way: last.pt, the requeue status, then the same command finishes the run."""
    from train.signals import EXIT_REQUEUE

    run_dir, steps = c.out / "runs" / "preempt", 60
    args = ["experiment=gpt_pydoc", f"model={gpt}", f"run_dir={run_dir}", f"trainer.max_steps={steps}",
            "trainer.eval_every=1000", "trainer.ckpt_every=1000", "trainer.num_workers=2"]
    proc = c.train("preempt", args, wait=False)
    t0 = time.time()
    while not (run_dir / "metrics.jsonl").exists() or len(records(run_dir)) < 3:
        if proc.poll() is not None or time.time() - t0 > 300:
            proc.kill()
            raise RuntimeError(f"no step 3 logged (status {proc.poll()}): {tail(c.out / 'preempt.log')}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    code = proc.wait(timeout=120)
    if code != EXIT_REQUEUE:
        raise RuntimeError(f"exit status {code}, expected {EXIT_REQUEUE}: {tail(c.out / 'preempt.log')}")
    from laplace.checkpoint import load_checkpoint

    stopped = load_checkpoint(run_dir / "ckpt/last.pt")["loop"]["step"]
    c.train("preempt", args)
    done = [r["step"] for r in records(run_dir)]
    if done != list(range(1, steps + 1)):
        raise RuntimeError(f"after the requeue, steps logged were {done[:5]}...{done[-3:]}")
    return f"signal at step ~3 -> saved step {stopped}, status {code}; requeued run finished {steps} steps"


def crash(c: Check, vit) -> str:
    """A bug in train_step with data workers (and compile) on: non-zero within seconds."""
    run_dir = c.out / "runs" / "crash"
    env = dict(c.env, CRASH_AT_STEP="3")
    c.train("crash", ["trainer.name=toy_trainers:Crashing", "model=vitt_0L", *vit, f"run_dir={run_dir}",
                      "trainer.num_workers=8", "trainer.max_steps=50", "trainer.global_batch_size=32"],
            expect=1, env=env, timeout=300)
    delay = time.time() - float((run_dir / "crash_time").read_text())
    if delay > 10:
        raise RuntimeError(f"exited {delay:.1f} s after the crash")
    if "ValueError: injected bug inside train_step" not in tail(c.out / "crash.log", 3):
        raise RuntimeError("the traceback of the bug is missing")
    return f"status 1, {delay:.1f} s after the exception, traceback kept"


def analysis(c: Check, device: str) -> str:
    out = []
    for name, extra in (("deit3_in1k", ["pca_maps=4"]), ("gpt_pydoc", [])):
        ckpt = c.out / "runs" / name / "ckpt/last.pt"
        c.sh("analysis", [sys.executable, "-m", "analysis", f"checkpoint={ckpt}", f"device={device}",
                          "max_tokens=20000", "progress=false", *extra], timeout=600)
        res = json.loads((ckpt.parent / "last_analysis" / "analysis.json").read_text())
        thr = res["throughput"]
        out.append(f"{name}: {res['n_tokens']:,} tokens at {thr['tokens_per_s']:,.0f}/s on {thr['device']}")
    return "; ".join(out)


def gpt_pipeline(c: Check, data: Path, gpt: str, device: str) -> str:
    """Built-in text -> BPE + shards -> Muon pre-training (stop + resume) -> SFT -> chat sampling."""
    shards = data / "pydoc_bpe"
    c.sh("gpt_tiny", [sys.executable, "prepare.py", "source=pydoc", "vocab_size=4096",
                      f"out={shards}", "progress=false"], timeout=300)
    pre = stop_and_resume(c, "gpt_tiny", ["experiment=gpt_tiny", f"model={gpt}", f"data.root={shards}",
                                          "trainer.eval_every=3"], 6, 16)
    sft_dir = c.out / "runs" / "gpt_tiny_sft"
    c.train("gpt_tiny_sft", ["experiment=gpt_tiny_sft", f"model={gpt}", f"run_dir={sft_dir}", "trainer.max_steps=3",
                             f"trainer.init_from={c.out / 'runs' / 'gpt_tiny' / 'ckpt/last.pt'}"])
    c.sh("generate", [sys.executable, "-m", "eval.generate", f"checkpoint={sft_dir / 'ckpt/last.pt'}", "chat=true",
                      "prompt=What is a class", "max_new_tokens=16", f"device={device}"], timeout=300)
    return f"pre-training {pre}; SFT 3 steps, val_loss={records(sft_dir, 'val')[-1]['val_loss']:.3f}; chat sampled"


def stdlib_parquet(folder: Path, files: int = 4) -> Path:
    """Python's standard-library sources (laplace.data.text.stdlib_texts, site-packages left out) as
    parquet files with a `text` column (FineWeb-Edu's layout; the last file is validation): real
    text found on every machine, enough for a 65,536-token BPE (~31 M characters; the BPE reaches
    its full vocabulary on the training files' capped documents in ~2 s on one core)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from laplace.data.text import stdlib_texts

    texts = stdlib_texts()
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        pq.write_table(pa.table({"text": texts[i::files]}), folder / f"shard_{i:05d}.parquet")
    return folder


def gpt_d20(c: Check, data: Path, tiny: bool) -> str:
    """A few steps of experiment=gpt_d20 as the paper runs it (560,988,160 parameters, 524,288
    tokens per step, bf16, compile), on a 65,536-token BPE of Python's standard library."""
    shards = data / "stdlib_bpe"
    c.sh("gpt_d20", [sys.executable, "prepare.py", f"source={stdlib_parquet(data / 'stdlib')}",
                     f"out={shards}", f"vocab_size={1024 if tiny else 65536}", "progress=false"], timeout=900)
    run_dir = c.out / "runs" / "gpt_d20"
    size = (["model=gpt_d2_1L", "data.vocab_size=1024", "data.seq_len=128",
             "trainer.global_batch_size=8", "trainer.micro_batch_size=4"] if tiny else ["model=gpt_d20_5L"])
    c.train("gpt_d20", ["experiment=gpt_d20", *size, f"data.root={shards}", f"run_dir={run_dir}", "trainer.max_steps=6",
                        "trainer.eval_every=6", "trainer.log_every=1", "data.val_tokens=524288"], timeout=1200)
    log = (c.out / "gpt_d20.log").read_text()
    params = next(ln for ln in log.splitlines() if " parameters; " in ln).split("] ", 1)[1]
    recs = records(run_dir)[2:]  # after compilation and warm-up
    tok_s = statistics.median(r["tok_per_s"] for r in recs)
    mfu = statistics.median(r.get("mfu", float("nan")) for r in recs)
    mfu = f"MFU {100 * mfu:.1f}%" if math.isfinite(mfu) else "no MFU (no known GPU peak)"
    return (f"{params}; {tok_s:,.0f} tokens/s, {mfu}, {step_ms(run_dir)}; "
            f"val_bpb={records(run_dir, 'val')[-1]['val_bpb']:.3f}")


def vision_evals(c: Check, device: str, seg: bool) -> str:
    """eval.knn + eval.linear, or eval.segmentation (trainer=seg_linear), on dino_digits' checkpoint."""
    ckpt = c.out / "runs" / "dino_digits" / "ckpt/last.pt"
    run = ckpt.parent.parent / "eval"
    if seg:
        c.sh("seg_linear", [sys.executable, "-m", "eval.segmentation", f"checkpoint={ckpt}", "eval=seg_digits_linear",
                            "iters=4", "trainer.eval_every=4", f"trainer.device={device}", "trainer.progress=false",
                            f"trainer.compile={str(c.args.compile).lower()}", f"paths.data_dir={c.out / 'data'}"])
        res = json.loads(next(run.glob("seg_*/results.json")).read_text())
        return f"4 iterations, mIoU={res['mIoU']:.2f}"
    c.sh("knn", [sys.executable, "-m", "eval.knn", f"checkpoint={ckpt}", f"device={device}"])
    c.sh("linear", [sys.executable, "-m", "eval.linear", f"checkpoint={ckpt}", f"device={device}", "epochs=2",
                    "lr_grid=[0.001,0.01]"])
    knn, lin = (json.loads((run / f"{k}_digits/results.json").read_text()) for k in ("knn", "linear"))
    return f"20-NN {knn['knn']['top1']:.2f}, linear {lin['linear']['top1']:.2f} (digits)"


def lm_eval(c: Check, device: str) -> str:
    """python -m eval.lm (the lm-eval adapter) on the SFT checkpoint, the built-in laplace_pydoc tasks."""
    ckpt = c.out / "runs" / "gpt_tiny_sft" / "ckpt/last.pt"
    c.sh("lm_eval", [sys.executable, "-m", "eval.lm", f"checkpoint={ckpt}", "tasks=[laplace_pydoc]",
                     f"device={device}", "limit=8", "batch_size=4", "bootstrap_iters=0"], timeout=600)
    res = json.loads(next((ckpt.parent.parent / "eval").glob("lm_*/results.json")).read_text())
    return ", ".join(f"{k}={v:.3f}" for k, v in res.items() if k.startswith("laplace_pydoc_") and
                     isinstance(v, float))


def benchmark(c: Check, args) -> str:
    """`python -m bench` (layer, training step, loader, tokenizer, analysis accumulator), eager; its
    records go to <out>/benchmarks; returns the ratios to k = 0 and to timm with their verdicts."""
    out = c.out / "benchmarks"
    cmd = [sys.executable, "-m", "bench", "--device", args.device, "--out", str(out)]
    cmd += ["--smoke"] if args.tiny else ["--steps", "10", "--warmup", "3", "--loader-tokens", "20000000"]
    c.sh("benchmark", cmd, timeout=900)
    record = max(out.glob("*.json"), key=lambda p: p.stat().st_mtime)
    rec = json.loads(record.read_text())
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    met = lambda m: "n/a" if m is None else "met" if m else "NOT met"  # noqa: E731
    lines = [f"{r['section']:<5} {r['mode']:<8} {r['num'] + ' / ' + r['den']:<34} time {fmt(r['time'])} "
             f"({met(r['time_met'])}), memory {fmt(r['memory'])} {r['memory_basis']} "
             f"({met(r['memory_met'])}), target <= {r['target']:.2f}" for r in rec["ratios"]]
    return f"record {record} (+ .md)\n     " + "\n     ".join(lines)


def table_path(table: str | None, device: str) -> Path | None:
    """Where the GPU table is written: --table if given, else README.md after a CUDA run only."""
    if table is not None:
        return Path(table)
    return ROOT / "README.md" if device.startswith("cuda") else None


def torch_device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else f"{device} (dry run)"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--tiny", action="store_true", help="smallest models (a CPU dry run)")
    p.add_argument("--out", default=None, help="folder for logs and runs (default: a temp folder)")
    p.add_argument("--only", nargs="*", default=None, help="run only these checks (first word of the name)")
    p.add_argument("--table", default=None, help="file whose GPU table gets this run's rows (default: "
                   "README.md on CUDA, none on CPU: a dry run never writes the README)")
    args = p.parse_args()
    table = table_path(args.table, args.device)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    rev = gpu_table.commit(ROOT)  # before the run, which may write README.md
    c = Check(args)
    print(f"[gpu_check] device={args.device} compile={args.compile} tiny={args.tiny} out={c.out}", flush=True)
    import fakedata
    from test_trainer_contract import write_token_shards

    data = c.out / "data"
    fakedata.write_imagenet_folder(data / "imagenet", n_classes=4, per_class=16)
    fakedata.write_cifar(data / "cifar", "cifar100", n_train=64, n_test=16)
    write_token_shards(data / "shards", tokens=40000)
    vit = ["model.depth=1", "model.embed_dim=96"] if args.tiny else ["model.depth=2"]
    gpt = "gpt_d2_1L" if args.tiny else "gpt_d12_6L"
    workers = f"trainer.num_workers={2 if args.tiny else 8}"
    in1k_ckpt = c.out / "runs" / "deit3_in1k" / "ckpt/last.pt"

    def probe():
        code = ("import torch; d = torch.device(%r); print('torch', torch.__version__, d, "
                "torch.cuda.get_device_name(d) if d.type == 'cuda' else 'cpu', "
                "'bf16' if d.type != 'cuda' or torch.cuda.is_bf16_supported() else 'no-bf16')" % args.device)
        c.sh("probe", [sys.executable, "-c", code], timeout=120)
        return tail(c.out / "probe.log")

    def tests(select: str):
        name = "flash" if "flash" in select else "tests"
        c.sh(name, [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-k", select],
             env=dict(c.env, LAPLACE_TEST_DEVICE=args.device), timeout=600)
        return tail(c.out / f"{name}.log")

    import torch

    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    checks = {
        "probe": probe,
        "tests -m cuda": lambda: tests("not flash_kernel"),
        "flash attention (SDPA's flash kernel forced)": lambda: tests("flash_kernel"),
        "compile: eager = compiled": lambda: gpu_cluster.compile_equality(c, data),
        "ranks: 2 processes, one model": lambda: gpu_cluster.ranks(c, data, gpus),
        "deit3_in1k": lambda: stop_and_resume(c, "deit3_in1k", [
            "experiment=deit3_in1k", "model=vitb_12L", *vit, f"data.root={data / 'imagenet'}",
            "data.img_size=64", "trainer.eval_every=2", workers], 6, 32),
        "deit3_in1k_ft224 (init_from a CUDA run)": lambda: stop_and_resume(c, "deit3_in1k_ft224", [
            "experiment=deit3_in1k_ft224", "model=vitb_12L", *vit, f"data.root={data / 'imagenet'}",
            "data.img_size=80", f"trainer.init_from={in1k_ckpt}", "trainer.eval_every=2", workers], 4, 32),
        "deit3_cifar100": lambda: stop_and_resume(c, "deit3_cifar100", [
            "experiment=deit3_cifar100", "model=vits_5L", *vit, f"data.root={data / 'cifar'}",
            "trainer.eval_every=2", workers], 4, 32),
        "gpt_pydoc": lambda: stop_and_resume(c, "gpt_pydoc", [
            "experiment=gpt_pydoc", f"model={gpt}", "trainer.eval_every=3", "trainer.num_workers=2"], 6, 32),
        "toy: 2 optimizers + EMA teacher": lambda: stop_and_resume(c, "ema_toy", [
            "trainer.name=toy_trainers:EMAToy", "model=vitt_1L", *vit, "trainer.eval_every=2",
            "+optim.schedules.weight_decay={value:0.05,warmup:null,start:null,warmdown:null,end:0.2,shape:cosine}",
            "trainer.schedules={ema_momentum:{value:0.9,warmup:null,start:null,warmdown:null,end:0.99,shape:linear}}", workers], 4, 32),
        "toy: streamed token shards": lambda: stop_and_resume(c, "stream_toy", [
            "trainer.name=toy_trainers:StreamLM", "trainer=gpt", "data=pydoc_text", f"model={gpt}",
            f"+data.root={data / 'shards'}", "data.seq_len=128", "trainer.num_workers=0"], 6, 16),
        "gpt pipeline: BPE, Muon, SFT, chat": lambda: gpt_pipeline(c, data, gpt, args.device),
        "gpt_d20: paper-size steps": lambda: gpt_d20(c, data, args.tiny),
        "gpt_d20_memory: micro batch 32 in 80 GB": lambda: gpu_cluster.gpt_d20_memory(c, args),
        "dino_digits": lambda: stop_and_resume(c, "dino_digits", [
            "experiment=dino_digits", "model=vits_5L", "trainer.num_workers=2"], 6, 64),
        "dino_in1k: paper-size steps": lambda: gpu_cluster.paper_images(c, "dino_in1k", data),
        "deit3: paper-size steps": lambda: gpu_cluster.paper_images(c, "deit3_in1k_author", data),
        "dino_in1k, crops on the GPU": lambda: gpu_cluster.paper_images(c, "dino_in1k", data,
                                                                        "trainer.multicrop.device_augment"),
        "deit3_in1k 3-Augment, crops on the GPU": lambda: gpu_cluster.paper_images(c, "deit3_in1k", data,
                                                                                   "data.device_augment"),
        "knn + linear": lambda: vision_evals(c, args.device, seg=False),
        "seg_linear": lambda: vision_evals(c, args.device, seg=True),
        "lm-eval: laplace_pydoc": lambda: lm_eval(c, args.device),
        "preemption (SIGUSR1)": lambda: preemption(c, gpt),
        "crash exits fast": lambda: crash(c, vit),
        "analysis of CUDA checkpoints": lambda: analysis(c, args.device),
        "benchmark": lambda: benchmark(c, args),
    }
    unknown = {n for names in gpu_table.ROWS.values() for n in names} - set(checks)
    if unknown:  # a renamed check would leave its README row at "never" for ever
        raise SystemExit(f"scripts/gpu_table.py ROWS names checks gpu_check lacks: {sorted(unknown)}")
    ran = {}
    for name, fn in checks.items():
        if args.only is None or name.split()[0].rstrip(":") in args.only:
            if (result := c.run(name, fn)) is not None:  # None: skipped
                ran[name] = result
    if table is not None:
        gpu = torch_device_name(args.device)
        command = " ".join(["bash scripts/gpu_check.sh", *sys.argv[1:]])
        atomic_write(table, gpu_table.update(table.read_text(), ran, when, gpu, rev, command).encode())
        print(f"[gpu_check] {table}: the GPU table's rows of these checks rewritten", flush=True)
    print(f"[gpu_check] {len(ran) - len(c.failed)}/{len(ran)} passed" +
          (f"; FAILED: {', '.join(c.failed)}" if c.failed else ""), flush=True)
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()
