"""Every run of the paper, its cost in GPU-hours, and its submission (`bash slurm/paper.sh` runs this).

    python scripts/paper_runs.py                                   # one row per sweep and stage, totals
    python scripts/paper_runs.py --runs                            # every run, one line each
    python scripts/paper_runs.py --only sweep=dino,k=5             # a subset (keys: sweep experiment model k seed stage)
    python scripts/paper_runs.py --only sweep=dino,k=0,k=5 --only sweep=gpt_d20,k=5   # a union of two
    python scripts/paper_runs.py --only sweep=deit3_vitb,k=0,k=12 --submit           # its sbatch lines (dry run)
    python scripts/paper_runs.py --only sweep=deit3_vitb,k=0 --submit --no-dry-run   # submitted
    python scripts/paper_runs.py --only sweep=gpt_d20 -- trainer.max_steps=100       # overrides for every run

The runs are the sweeps README's "Paper experiments" names: the first author's DeiT-III ViT-B and
ViT-L sweeps on ImageNet (his timm fork's imagenet_sweep_{base,large}_mixed.sh: k x seeds 0-2),
the GPT d20 sweep k = 0..10 (pre-training, mid-training, SFT: slurm/chains/gpt_d20.sh) and the
DINO ViT-S sweep k = 0..6 (pre-training, k-NN, linear probe, ADE20K: slurm/chains/dino.sh). The
paper names no seeds for the GPT and DINO rows: one seed each here (--seeds widens them).

Cost. Steps come from the composed experiment by train.recipe's own arithmetic (epochs x steps per
epoch of the card's data size, or the GPT's token budget). FLOPs per step: torch's FlopCounterMode
over one forward and backward of the trainer's own model on fake tensors (no memory, no data):
ViT and DINO (student on every crop, teacher on the global crops) per image x the global batch;
the GPT by nanochat's estimate (train.gpt.flops_per_token, the one its logged MFU uses) x tokens
per step. Evaluations: the frozen backbone's forward over their images (k-NN: train + val and the
similarity matmul; linear: the extraction and every head of the lr grid on cached features;
ADE20K: 40k x 16 crops at 512 px and the sliding-window test), counted the same way. GPU-hours =
FLOPs / (MFU x the H200's bf16 peak, train.gpt.PEAK_BF16_FLOPS), the MFU taken from the one
measured run of each family: a ViT-B/16 at 224 px training at 2,285 img/s eager on an H200
(bench.images.GPU_RECORD) and the d20 GPT at ~80 k tokens/s on an H200 (docs/LOG.md, "Data loader
and tokenizer speed"), each turned into an MFU by the same FLOPs count. Not included: the
analysis and LM-benchmark jobs (minutes), data loading slower than the GPU, restarts.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from laplace.errors import ConfigError, cli_errors  # noqa: E402

H200 = "H200"
IMAGENET_VAL, ADE_VAL = 50_000, 2_000  # validation images (ImageNet-1k; ADE20K's SceneParse150)
ADE_WINDOWS = 2  # sliding windows (512, stride 341) per ADE20K test image at a 512 short side, 4:3
# The d20 GPT on one H200 (docs/LOG.md, "Data loader and tokenizer speed"): ~80 k tokens/s.
GPT_RECORD = dict(gpu="NVIDIA H200", model="gpt_d20_0L", tokens_per_s=80_000.0,
                  source="docs/LOG.md (the d20 GPT on an H200, ~80 k tokens/s)")


@dataclass(frozen=True)
class Sweep:
    """One paper sweep: `arch`_<k>L models x seeds, each a chain of `stages` (stage 1 trains)."""
    name: str
    experiment: str
    arch: str
    ks: tuple[int, ...]
    seeds: tuple[int, ...]
    stages: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    sbatch: tuple[str, ...] = ()  # sbatch flags of the training stage
    family: str = "vit"           # whose measured MFU applies: vit | gpt
    source: str = ""


SWEEPS = (
    Sweep("deit3_vitb", "deit3_in1k_author", "vitb", (0, 1, 3, 6, 9, 11, 12), (0, 1, 2), ("train",),
          sbatch=("--ntasks-per-node=4", "--gpus-per-node=4", "--time=03:00:00"),
          source="the first author's imagenet_sweep_base_mixed.sh (README, paper experiment 1)"),
    Sweep("deit3_vitl", "deit3_in1k_author", "vitl", (0, 4, 8, 12, 16), (0, 1, 2), ("train",),
          overrides=("model.drop_path_rate=0.45",),
          sbatch=("--ntasks-per-node=4", "--gpus-per-node=4", "--time=03:00:00"),
          source="the first author's imagenet_sweep_large_mixed.sh (README, paper experiment 1)"),
    Sweep("gpt_d20", "gpt_d20", "gpt_d20", tuple(range(11)), (0,), ("train", "gpt_d20_mid", "gpt_d20_sft"),
          family="gpt", source="README, paper experiment 2: sweep k = 0..10; slurm/chains/gpt_d20.sh"),
    Sweep("dino", "dino_in1k", "vits", tuple(range(7)), (0,), ("train", "knn", "linear", "seg"),
          source="configs/experiment/dino_in1k.yaml: k = 0..6; slurm/chains/dino.sh"),
)


@dataclass
class Run:
    sweep: Sweep
    stage: str
    k: int
    seed: int
    steps: int = 0
    flops_per_step: float = 0.0
    unit: str = "step"
    gpu_hours: float = 0.0
    experiment: str = field(init=False)

    def __post_init__(self):
        self.experiment = {"train": self.sweep.experiment, "knn": "eval.knn", "linear": "eval.linear",
                           "seg": "eval.segmentation"}.get(self.stage, self.stage)

    @property
    def model(self) -> str:
        return f"{self.sweep.arch}_{self.k}L"

    def fields(self) -> dict[str, str]:
        return dict(zip(FIELDS, (self.sweep.name, self.experiment, self.model, str(self.k), str(self.seed),
                                 self.stage)))


FIELDS = ("sweep", "experiment", "model", "k", "seed", "stage")  # what --only selects on


# ---------------------------------------------------------------- FLOPs


def counted(model, fn) -> float:
    """FLOPs of fn(model, make) (torch's FlopCounterMode: matmuls, convolutions, attention;
    forward and backward when fn calls backward), `make(*shape)` making its inputs. The model,
    built on the meta device, runs on fake CPU tensors (shapes only, no memory): the meta device
    itself fails in the DINO head's torch.autocast("meta"). Attention through SDPA's math path:
    its matmuls are counted (the CPU's fused kernel has no FLOPs rule: ~3% of a ViT-B step lost)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with FakeTensorMode(allow_non_fake_inputs=True), sdpa_kernel(SDPBackend.MATH):
        model = model.to_empty(device="cpu")
        with FlopCounterMode(display=False) as fc:
            fn(model, lambda *shape: torch.empty(*shape))
    return float(fc.get_total_flops())


def vit_flops(model, img_size: int, train: bool) -> float:
    """FLOPs per image of a ViT at img_size: forward, or forward + backward when `train`."""
    def step(m, make):
        x = make(2, 3, img_size, img_size)  # 2 images: a BatchNorm head needs a batch
        if train:
            m(x).float().sum().backward()
        else:
            with torch.no_grad():
                m(x)
    return counted(model, step) / 2


def recipe(experiment: str, overrides: list[str]):
    """train.recipe's Recipe of an experiment composed with its card's overrides + ours."""
    from train.recipe import Recipe, compose_config, load_reference

    ref = load_reference(experiment)
    cfg = compose_config([f"experiment={experiment}", *ref.get("overrides", []), *overrides])
    return Recipe(cfg, ref.get("assume", {}).get("train_size"))


def train_cost(experiment: str, overrides: tuple[str, ...]) -> tuple[int, float]:
    """(optimizer steps, FLOPs per step) of a training run."""
    r = recipe(experiment, list(overrides))
    cfg, model = r.cfg, r.trainer.model
    steps, batch = r.total_steps(), cfg.trainer.global_batch_size
    if cfg.trainer.name == "gpt":
        from train.gpt import flops_per_token

        return steps, flops_per_token(model, cfg.data.seq_len) * r.tokens_per_step()
    if cfg.trainer.name == "dino":
        mc = cfg.trainer.multicrop

        def step(m, make):  # the student on every crop, the teacher on the global ones, the loss
            crops = [make(2, 3, mc.global_size, mc.global_size) for _ in mc.global_blur] + \
                    [make(2, 3, mc.local_size, mc.local_size) for _ in range(mc.local_crops)]
            m(crops, 0.04).backward()
        return steps, counted(model, step) / 2 * batch
    return steps, vit_flops(model, cfg.data.img_size, train=True) * batch


def eval_cost(stage: str, pre_experiment: str, overrides: tuple[str, ...]) -> tuple[int, float]:
    """(images, FLOPs per image) of an evaluation of the backbone a pre-training run exports, by
    the evaluation's own entry config (configs/{knn,linear,segmentation}.yaml)."""
    from train.recipe import compose_config

    r = recipe(pre_experiment, list(overrides))
    backbone, train_size = r.trainer.export_model(), int(r.train_size)
    if stage == "seg":
        e = compose_config(["checkpoint=x"], "segmentation")
        images = e.iters * e.batch_size + ADE_VAL * ADE_WINDOWS
        return images, vit_flops(backbone, e.crop_size, train=False)  # the linear head: 0.2% of it
    e = compose_config(["checkpoint=x", "data=imagenet"], stage)
    images = train_size + IMAGENET_VAL
    fwd = vit_flops(backbone, e.data.img_size, train=False)
    dim, classes = backbone.embed_dim, e.data.num_classes
    if stage == "knn":  # every val feature against every train feature
        extra = 2 * IMAGENET_VAL * train_size * dim
    else:  # the lr grid's heads on cached features (held out, then the chosen one retrained)
        feats = dim * e.n_last_blocks
        extra = 6 * feats * classes * e.epochs * train_size * ((1 - e.val_fraction) * len(e.lr_grid) + e.retrain)
    return images, fwd + extra / images


@lru_cache(maxsize=None)
def rates() -> dict[str, float]:
    """FLOP/s of one H200 per family, from the measured runs counted by the same FLOPs rules."""
    from bench.images import GPU_RECORD
    from train.gpt import PEAK_BF16_FLOPS, flops_per_token

    vit = recipe("deit3_in1k", ["model=vitb_0L", "data.img_size=224"])
    vit_rate = GPU_RECORD["images_per_s"] * vit_flops(vit.trainer.model, 224, train=True)
    gpt = recipe("gpt_d20", [f"model={GPT_RECORD['model']}"])
    gpt_rate = GPT_RECORD["tokens_per_s"] * flops_per_token(gpt.trainer.model, gpt.cfg.data.seq_len)
    return {"vit": vit_rate, "gpt": gpt_rate, "peak": PEAK_BF16_FLOPS[H200]}


def _matcher(spec: str):
    """A filter from "KEY=V,KEY=V...": a key given twice matches either value, keys must all match."""
    want: dict[str, set[str]] = {}
    for word in (w for w in spec.split(",") if w):
        key, sep, value = word.partition("=")
        if not sep or key not in FIELDS:
            raise ConfigError(f"--only {spec}: '{word}' is no KEY=VALUE with KEY one of {', '.join(FIELDS)}")
        want.setdefault(key, set()).add(value)
    return lambda f: all(f[key] in values for key, values in want.items())


def runs(only: list[str] = (), overrides: list[str] = (), seeds: dict[str, tuple[int, ...]] | None = None) -> list[Run]:
    """The paper's runs that match any filter in `only` (all of them without one; see _matcher),
    costed with `overrides` on top of each sweep's; `seeds`: another seed list per sweep name."""
    matchers = [_matcher(spec) for spec in only]
    out = []
    for sw in SWEEPS:
        for stage in sw.stages:
            for k in sw.ks:
                for seed in (seeds or {}).get(sw.name, sw.seeds):
                    run = Run(sw, stage, k, seed)
                    if not matchers or any(m(run.fields()) for m in matchers):
                        out.append(run)
    if not out:
        raise ConfigError(f"--only {' --only '.join(only)}: no run of the paper matches "
                          f"(bash slurm/paper.sh --runs lists them)")
    cache: dict = {}
    for run in out:
        # The cost of a sweep's stage is the same at every k: the Laplacian heads' subtraction is
        # no matmul (counted FLOPs equal at k = 0 and all heads, tests/test_paper_runs.py).
        key = (run.sweep.name, run.stage)
        if key not in cache:
            ov = (f"model={run.sweep.arch}_{run.sweep.ks[0]}L", *run.sweep.overrides, *overrides)
            if run.stage == "train":
                cache[key] = (*train_cost(run.sweep.experiment, ov), "step")
            elif run.stage in ("knn", "linear", "seg"):
                cache[key] = (*eval_cost(run.stage, run.sweep.experiment, ov), "img")
            else:  # a later training stage of the chain (mid-training, SFT), initialised from the one
                # before; data.root= belongs to the pre-training there (slurm/chains/gpt_d20.sh)
                ov = (*ov[:1], "trainer.init_from=x", *(o for o in ov[1:] if not o.startswith("data.root=")))
                cache[key] = (*train_cost(run.stage, ov), "step")
        run.steps, run.flops_per_step, run.unit = cache[key]
        run.gpu_hours = run.steps * run.flops_per_step / rates()[run.sweep.family] / 3600
    return out


# ---------------------------------------------------------------- output


def _g(x: float) -> str:
    """3 significant figures, thousands separated: 2,436 / 45.8 / 0.0138."""
    return f"{x:,.0f}" if x >= 100 else f"{float(f'{x:.3g}'):g}"


def table(selected: list[Run]) -> str:
    """One row per sweep and stage: runs, steps (or images) and cost per run, GPU-hours in all."""
    groups = {}
    for r in selected:
        groups.setdefault((r.sweep.name, r.stage), []).append(r)
    lines = ["| sweep | stage | experiment | k | seeds | runs | steps (images) per run | TFLOP per step (image) | "
             "H200-hours per run | H200-hours |", "|" + "---|" * 10]
    total_runs = total_hours = 0.0
    for (name, stage), rs in groups.items():
        r0, hours = rs[0], sum(r.gpu_hours for r in rs)
        ks = ",".join(map(str, sorted({r.k for r in rs})))
        seeds = ",".join(map(str, sorted({r.seed for r in rs})))
        steps = f"{r0.steps:,}" + (" img" if r0.unit == "img" else "")
        lines.append(f"| {name} | {stage} | {r0.experiment} | {ks} | {seeds} | {len(rs)} | {steps} "
                     f"| {_g(r0.flops_per_step / 1e12)} | {_g(r0.gpu_hours)} | {_g(hours)} |")
        total_runs += len(rs)
        total_hours += hours
    lines.append(f"| **total** | | | | | {int(total_runs)} | | | | **{_g(total_hours)}** |")
    rt = rates()
    lines.append("")
    lines.append(f"H200 bf16 peak {rt['peak'] / 1e12:.0f} TFLOP/s; MFU from the measured runs: ViT "
                 f"{rt['vit'] / rt['peak']:.1%} (ViT-B/16, 224 px, 2,285 img/s eager), GPT {rt['gpt'] / rt['peak']:.1%} "
                 f"(d20, ~80 k tokens/s).\n"
                 "Evaluations at the ViT's MFU: a lower bound (their feature extraction waits on the data "
                 "loader). Not counted: the analysis and LM-benchmark jobs.")
    return "\n".join(lines)


def submissions(selected: list[Run], overrides: list[str], code_execution: bool) -> list[list[str]]:
    """The slurm/ commands that run the selected runs: slurm/sweep.sh per DeiT-III model (its
    seeds), slurm/chains/gpt_d20.sh and slurm/chains/dino.sh per (model, seed) chain (a chain is
    submitted whole when any of its stages is selected)."""
    cmds, seen = [], set()
    for r in selected:
        sw = r.sweep
        if sw.name.startswith("deit3"):
            key = (sw.name, r.k)
            if key in seen:
                continue
            seeds = sorted({x.seed for x in selected if x.sweep is sw and x.k == r.k})
            cmds.append(["bash", "slurm/sweep.sh", "--models", r.model, "--seeds", ",".join(map(str, seeds)),
                         *sw.sbatch, "--", f"experiment={sw.experiment}", *sw.overrides, *overrides])
        else:
            key = (sw.name, r.k, r.seed)
            if key in seen:
                continue
            chain = "slurm/chains/gpt_d20.sh" if sw.name == "gpt_d20" else "slurm/chains/dino.sh"
            opt = ["--allow-code-execution"] if code_execution and sw.name == "gpt_d20" else []
            exp = [] if sw.name == "gpt_d20" else [f"experiment={sw.experiment}"]
            cmds.append(["bash", chain, r.model, *opt, *sw.sbatch, *exp, f"seed={r.seed}", *sw.overrides, *overrides])
        seen.add(key)
    return cmds


@cli_errors
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="bash slurm/paper.sh", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", default=[], metavar="KEY=V[,KEY=V...]",
                   help="select the runs whose KEYs (sweep experiment model k seed stage) all match, a key "
                        "given twice matching either value; repeated: the runs of any")
    p.add_argument("--seeds", action="append", default=[], metavar="SWEEP=0,1,2",
                   help="another seed list for a sweep (e.g. dino=0,1,2)")
    p.add_argument("--runs", action="store_true", help="list every run, one line each, instead of the table")
    p.add_argument("--submit", action="store_true", help="submit the selected runs (a dry run unless --no-dry-run)")
    p.add_argument("--no-dry-run", dest="dry_run", action="store_false", help="with --submit: really submit")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="the GPT chains' benchmarks include HumanEval (runs model-written code)")
    a = p.parse_args(argv)
    seeds = {}
    for spec in a.seeds:
        name, _, values = spec.partition("=")
        if name not in {s.name for s in SWEEPS} or not values:
            raise ConfigError(f"--seeds {spec}: use SWEEP=0,1,... with SWEEP one of {', '.join(s.name for s in SWEEPS)}")
        seeds[name] = tuple(int(v) for v in values.split(","))
    selected = runs(a.only, overrides, seeds)
    if a.runs:
        for r in selected:
            print(f"{r.sweep.name:11s} {r.stage:12s} {r.model:13s} seed={r.seed}  {r.steps:>10,} {r.unit:4s} "
                  f"{r.gpu_hours:10,.1f} H200-h")
        print(f"{len(selected)} runs, {sum(r.gpu_hours for r in selected):,.0f} H200-hours")
    else:
        print(table(selected))
    if a.submit:
        env = {**os.environ, **({"LAPLACE_DRY_RUN": "1"} if a.dry_run else {})}
        for cmd in submissions(selected, overrides, a.allow_code_execution):
            print("$ " + shlex.join(cmd), file=sys.stderr, flush=True)
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
