"""The checks of scripts/gpu_check.py that a cluster job depends on: the shipped paper experiments
eager and compiled (same losses, no graph break), one model on every rank over NCCL (and the
losses of one GPU at the same global batch), and the paper's image runs with their data loader
measured alone beside them. Each function takes gpu_check's `Check` and returns its line.

Tiny sizes of the shipped experiments (TINY), so a check costs start-up and compilation only;
randomness that differs between ranks or between eager and compiled code (drop-path, Mixup and
CutMix) is off, so their losses can be compared step by step.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4


def tiny(data: Path) -> dict[str, list[str]]:
    """experiment -> the overrides that shrink it (deterministic forward, 4 steps)."""
    images = [f"data.root={data / 'imagenet'}", "data.img_size=64", "model.drop_path_rate=0.0",
              "trainer.global_batch_size=16", "trainer.num_workers=2"]
    return {
        # the paper's ImageNet run as its first author ran it (QK-norm, timm's '3a', AdamW)
        "deit3_in1k_author": ["experiment=deit3_in1k_author", "model=vitb_12L", "model.depth=2", *images,
                              "trainer.micro_batch_size=null", "trainer.mixup=0.0", "trainer.cutmix=0.0",
                              "trainer.eval_every=100"],
        "gpt_d20": ["experiment=gpt_d20", "model=gpt_d2_1L", f"data.root={data / 'pydoc_512'}", "data.vocab_size=512",
                    "data.seq_len=128", "data.val_tokens=8192", "trainer.global_batch_size=8",
                    "trainer.micro_batch_size=null", "trainer.sample_prompts=[]", "trainer.eval_every=100"],
        "dino_in1k": ["experiment=dino_in1k", "model=vits_5L", "model.depth=1", "model.embed_dim=96", *images,
                      "trainer.multicrop.local_size=32", "trainer.multicrop.local_crops=2",
                      "trainer.head.out_dim=256"],
    }


def prepare_text(c, data: Path) -> Path:
    """A 512-token BPE of the built-in text and its shards (a few seconds), once per --out."""
    out = data / "pydoc_512"
    if not (out / "meta.json").exists():
        c.sh("prepare_512", [sys.executable, "prepare.py", "source=pydoc", "vocab_size=512", f"out={out}",
                             "progress=false"], timeout=300)
    return out


def losses(run_dir: Path) -> list[float]:
    from train.logger import logged

    return [r["loss"] for r in logged(run_dir, "train")]


def close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol, abs_tol=rtol) for x, y in zip(a, b))


def compile_equality(c, data: Path) -> str:
    """Each tiny paper experiment eager and compiled (as shipped: trainer.compile=auto, on with
    CUDA), one process each, side by side: the losses agree within bf16 rounding and the compiled
    runs have no graph break."""
    if not c.args.compile:
        return "SKIP: --no-compile"
    prepare_text(c, data)
    runs = {}
    for name, over in tiny(data).items():
        for mode in ("eager", "compiled"):
            run_dir = c.out / "runs" / "compile" / f"{name}_{mode}"
            runs[name, mode] = run_dir
            compile_ = [f"trainer.compile={str(mode == 'compiled').lower()}"]  # true: auto's choice on CUDA
            c.train(f"compile_{name}_{mode}", [*over, *compile_, f"run_dir={run_dir}", f"trainer.max_steps={STEPS}"],
                    wait=False)
    c.wait_all(timeout=900)
    tol = 2e-2 if c.args.device.startswith("cuda") else 1e-4  # bf16 autocast on CUDA
    out, bad = [], []
    for name in tiny(data):
        eager, compiled = losses(runs[name, "eager"]), losses(runs[name, "compiled"])
        if not close(eager, compiled, tol):
            bad.append(f"{name}: eager {eager} vs compiled {compiled}")
        out.append(f"{name} {max(abs(a - b) / abs(a) for a, b in zip(eager, compiled)):.1e}")
    breaks = c.probe()[1].get("break_reasons")
    if bad or breaks:
        raise RuntimeError("; ".join(bad + [f"graph breaks: {breaks}"] * bool(breaks)))
    return "largest relative loss gap eager vs compiled: " + ", ".join(out)


def ranks(c, data: Path, gpus: int) -> str:
    """torchrun of 2 processes (NCCL on GPUs, gloo on a CPU dry run) over the tiny experiments,
    each stopped half-way and resumed (tests/ddp_ranks.py): every parameter and buffer of the whole
    trained module (DINO's teacher and centre too) is bitwise the same on both ranks after set-up,
    the stop, the resume and the end, and the logged losses equal one GPU's at the same global
    batch (compile_equality's compiled runs on CUDA, else their own)."""
    if c.args.device.startswith("cuda") and gpus < 2:
        return f"SKIP: {gpus} GPU on this node (a multi-GPU node runs 2 ranks)"
    prepare_text(c, data)
    out = c.out / "runs" / "ranks" / "out"
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(" ".join([name, "config", *over, *c.common, f"trainer.max_steps={STEPS}",
                                f"trainer.stop_after={STEPS // 2}"]) for name, over in tiny(data).items())
    c.torchrun("ranks", 2, ROOT / "tests/ddp_ranks.py", [str(out), lines], timeout=900)
    result, gaps = json.loads(out.read_text()), []
    differ = rank_differences(result)
    for name in result:
        one = c.out / "runs" / "compile" / f"{name}_compiled"  # = auto's choice on CUDA only
        if not (c.args.compile and c.args.device.startswith("cuda") and (one / "metrics.jsonl").exists()):
            one = c.out / "runs" / "ranks" / f"{name}_one"
            c.train(f"ranks_{name}_one", [*tiny(data)[name], f"run_dir={one}", f"trainer.max_steps={STEPS}"])
        a, b = losses(one), losses(Path(f"{out}.{name}"))
        if not close(a, b, 2e-2 if c.args.device.startswith("cuda") else 1e-4):
            differ.append(f"{name}: 1 process {a} vs 2 {b}")
        gaps.append(f"{name} {max(abs(x - y) / abs(x) for x, y in zip(a, b)):.1e}")
    if differ:
        raise RuntimeError("; ".join(differ))
    return (f"2 ranks hold one model after set-up, stop, resume and end ({', '.join(result)}); "
            f"largest relative loss gap to 1 process: {', '.join(gaps)}")


def rank_differences(result: dict) -> list[str]:
    """'<run> <phase>: N tensors differ (names)' wherever a rank's fingerprint is not rank 0's
    (tests/ddp_ranks.py's result: run -> phases -> one {tensor: sha1} per rank)."""
    out = []
    for name, res in result.items():
        for phase, prints in res["phases"].items():
            keys = set().union(*prints)
            bad = sorted(k for k in keys if any(p.get(k) != prints[0].get(k) for p in prints[1:]))
            if bad:
                out.append(f"{name} {phase}: {len(bad)} tensors differ ({', '.join(bad[:3])})")
    return out


def image_folder(data: Path, tiny: bool) -> Path:
    """ImageNet-sized JPEGs (320 px; 1,024 of them: several steps before an epoch ends)."""
    folder = data / "imagenet_320px"
    if not folder.exists():
        import fakedata

        fakedata.write_imagenet_folder(folder, n_classes=4, per_class=16 if tiny else 256, size=64 if tiny else 320)
    return folder


def paper_sizes(tiny: bool) -> dict[str, list[str]]:
    """The image experiments per GPU as the paper runs them; tiny: the smallest that still runs."""
    small = ["model.depth=1", "model.embed_dim=96", "data.img_size=64", "trainer.global_batch_size=16",
             "trainer.num_workers=2"]
    deit3 = ["model=vitb_12L", *(small + ["trainer.micro_batch_size=null"] if tiny else
                                 ["trainer.global_batch_size=256", "trainer.num_workers=8"])]
    return {"deit3_in1k_author": deit3, "deit3_in1k": deit3,
            "dino_in1k": ["model=vits_5L", *(small + ["trainer.multicrop.local_size=32", "trainer.head.out_dim=1024"]
                                             if tiny else ["trainer.global_batch_size=64", "trainer.num_workers=8"])]}


def paper_images(c, name: str, data: Path, device_augment: str | None = None) -> str:
    """Ten steps of experiment=<name> as the paper runs it per GPU (bf16, compiled as shipped),
    then its data loader alone (the same feed, the model not run): training images/s beside the
    images/s the loader gives one process at the production worker count. A loader slower than
    the GPU bounds the run. device_augment: the config key that moves the crops and colour work
    to the GPU (data.device_augment, trainer.multicrop.device_augment), set true: the training
    figure then includes their GPU time, the loader's is the workers' decode alone."""
    size = paper_sizes(c.args.tiny)[name.replace("deit3_in1k_author", "deit3_in1k") if device_augment else name]
    folder = image_folder(data, c.args.tiny)
    label = f"{name}_device" if device_augment else name
    run_dir = c.out / "runs" / label
    over = [f"experiment={name}", *size, f"data.root={folder}", "trainer.max_steps=10", "trainer.eval_every=1000",
            *([f"{device_augment}=true"] if device_augment else [])]
    c.train(label, [*over, f"run_dir={run_dir}", "trainer.log_every=1"], timeout=900)
    from train.logger import logged

    recs = logged(run_dir, "train")[2:]  # after compilation and warm-up
    gpu = statistics.median(r["img_per_s"] for r in recs)
    code = f"import gpu_cluster; gpu_cluster.print_loader_rate({[*over, *c.common, f'run_dir={run_dir}_loader']!r})"
    c.sh(f"{label}_loader", [sys.executable, "-c", code], timeout=600)
    rate = float(next(ln for ln in (c.out / f"{label}_loader.log").read_text().splitlines()
                      if ln.startswith("LOADER ")).split()[1])
    bound = "loader-bound" if rate < 1.1 * gpu else "the model's step bounds it"
    ms = statistics.median(r["step_ms"] for r in recs)
    return (f"{gpu:,.0f} img/s training ({ms:.0f} ms/step), {rate:,.0f} img/s from the loader alone "
            f"({bound}); loss {recs[-1]['loss']:.3f}")


def print_loader_rate(overrides: list[str], batches: int = 20):
    """Prints 'LOADER <samples/s>': what one process's training feed of this config delivers
    (after two batches per worker), the model built but not run."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from laplace.config import register_model_configs
    from train import get_trainer

    register_model_configs([o.split("=", 1)[1] for o in overrides if o.startswith("model=")])
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[o for o in overrides if not o.startswith("run_dir=")])
    with open_dict(cfg):
        cfg.run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run_dir="))
    trainer = get_trainer(cfg.trainer.name)(cfg).setup()
    feed = iter(trainer.feed)
    for _ in range(2 * max(1, cfg.trainer.num_workers)):
        next(feed)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(feed)
    print(f"LOADER {batches * trainer.micro_bs / (time.perf_counter() - t0):.1f}", flush=True)


def gpt_d20_memory(c, args) -> str:
    """gpt_d20 at the paper's micro batch, 32 x 2048 tokens per GPU (nanochat's d20 fits it in an 80 GB
    H100): peak memory of two training steps of gpt_d20_5L with the process held to an 80 GB card's
    79.6 GiB, without and with model.grad_checkpointing, compiled as the runs are
    (`python -m bench --sections gpt_memory`, its record in <out>/benchmarks; one GPU, so DDP's
    gradient buckets, ~2.2 GB more on several, are not in it). Fails if the shipped setting (no
    checkpointing) runs out of memory, naming what to set."""
    out = c.out / "benchmarks" / "gpt_d20_memory"
    size = ["--smoke"] if args.tiny else ["--memory-depths", "20", "--gpt-batch-size", "32", "--seq-len", "2048",
                                          "--vocab-size", "65536", "--memory-cap-gib", "79.6"]
    c.sh("gpt_d20_memory", [sys.executable, "-m", "bench", "--device", args.device, "--sections", "gpt_memory",
                            *size, *(["--compile"] if args.compile else []), "--out", str(out)], timeout=900)
    mem = json.loads(max(out.glob("*.json"), key=lambda f: f.stat().st_mtime).read_text())["gpt_memory"]
    rows = [r for r in mem["rows"] if "oom" in r] or mem["rows"]  # CPU dry run: no peaks
    fmt = lambda r: ("OOM" if r["oom"] else f"{r['peak_gib']:.1f} GiB") if "oom" in r else "no peak on CPU"  # noqa: E731
    what = "; ".join(f"{r['name']}{' grad_checkpointing' if r['grad_checkpointing'] else ''}: {fmt(r)}, "
                     f"{r['saved_bytes_per_token']:,.0f} saved B/token" for r in rows)
    if any(r.get("oom") and not r["grad_checkpointing"] for r in rows):
        raise RuntimeError(f"gpt_d20's micro batch {mem['batch']} does not fit {mem['cap_gib']} GiB: set "
                           f"model.grad_checkpointing=true or trainer.micro_batch_size=16 ({what})")
    return what
