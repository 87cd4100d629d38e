"""Every run of the paper, its cost in H200-hours, and its submission (`bash slurm/paper.sh` runs this).

    bash slurm/paper.sh                                          # one row per sweep and stage, totals
    bash slurm/paper.sh --runs                                   # every run, one row each
    bash slurm/paper.sh --only sweep=dino,k=0,k=5 --only sweep=gpt_d20,k=5   # a union of two subsets
    bash slurm/paper.sh --only sweep=deit3_vitb,k=0 --submit [--no-dry-run]  # sbatch lines (or submitted)
    bash slurm/paper.sh --only sweep=gpt_d20 -- trainer.max_steps=100        # overrides for every run

The sweeps are README's "The paper's experiments" (docs/slurm.md "The paper's runs"; the values'
sources: SWEEPS). A run's cost is its steps (train.recipe's arithmetic on the composed experiment)
x its FLOPs per step (torch's FlopCounterMode over one forward and backward of the trainer's own
model on fake tensors), over the H200 FLOP/s of the one measured run of each family (VIT_RECORD,
GPT_RECORD). Not counted: the evaluations, analysis and LM-benchmark jobs (minutes each: the DINO
evaluations' FLOPs came to 0.6 of 3,912 hours, and their data loader, not the GPU, bounds them), a
data loader slower than the GPU, restarts.
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from laplace.errors import ConfigError, UserError, cli_errors  # noqa: E402
from train.recipe import reference_recipe  # noqa: E402

# The measured H200 runs whose MFU every estimate assumes (an early run, commit not recorded: a
# ViT-B/16 training step at 224 px, eager, bf16; the d20 GPT: docs/LOG.md "Data loader and tokenizer speed").
VIT_RECORD = dict(experiment="deit3_in1k", model="vitb_0L", img_size=224, images_per_s=2285.0)
GPT_RECORD = dict(experiment="gpt_d20", model="gpt_d20_0L", tokens_per_s=80_000.0)
AUTHOR_GPUS = ("--ntasks-per-node=4", "--gpus-per-node=4", "--time=03:00:00")  # his sweeps' 4 GPUs
# One row per sweep: its experiment, model prefix (+ "_<k>L"), ks, seeds, the chain's stages (the first
# trains), overrides, sbatch flags, whose MFU applies. The paper names no seeds for the GPT and DINO: one each.
SWEEPS = pd.DataFrame.from_records([
    # the first author's timm fork: imagenet_sweep_base_mixed.sh, imagenet_sweep_large_mixed.sh
    ("deit3_vitb", "deit3_in1k_author", "vitb", [0, 1, 3, 6, 9, 11, 12], [0, 1, 2], ["train"], [], AUTHOR_GPUS, "vit"),
    ("deit3_vitl", "deit3_in1k_author", "vitl", [0, 4, 8, 12, 16], [0, 1, 2], ["train"],
     ["model.drop_path_rate=0.45"], AUTHOR_GPUS, "vit"),
    # configs/experiment/gpt_d20.yaml: k = 0..10; slurm/chains/gpt_d20.sh
    ("gpt_d20", "gpt_d20", "gpt_d20", list(range(11)), [0], ["train", "gpt_d20_mid", "gpt_d20_sft"], [], [], "gpt"),
    # configs/experiment/dino_in1k.yaml: k = 0..6; slurm/chains/dino.sh
    ("dino", "dino_in1k", "vits", list(range(7)), [0], ["train", "knn", "linear", "seg"], [], [], "vit"),
], columns=["sweep", "experiment", "arch", "k", "seed", "stage", "extra", "sbatch", "family"], index="sweep")
KEYS = ("sweep", "experiment", "model", "k", "seed", "stage")  # what --only selects on
EVALS = {"knn": "eval.knn", "linear": "eval.linear", "seg": "eval.segmentation"}


def counted(model, fn) -> float:
    """FLOPs of fn(model, make) by torch's FlopCounterMode, `make(*shape)` making the inputs. The
    model (built on the meta device) runs on fake CPU tensors: shapes only, no memory (the meta
    device itself fails in the DINO head's torch.autocast("meta")). SDPA's math path, so that its
    matmuls are counted (the CPU's fused kernel has no FLOPs rule: ~3% of a ViT-B step lost)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with FakeTensorMode(allow_non_fake_inputs=True), sdpa_kernel(SDPBackend.MATH):
        model = model.to_empty(device="cpu")
        with FlopCounterMode(display=False) as fc:
            fn(model, lambda *shape: torch.empty(*shape))
    return float(fc.get_total_flops())


def vit_flops(model, img_size: int) -> float:
    """FLOPs per image of a ViT's training step (forward + backward)."""
    def step(m, make):  # 2 images: a BatchNorm head needs a batch
        m(make(2, 3, img_size, img_size)).float().sum().backward()
    return counted(model, step) / 2


def train_cost(experiment: str, overrides: tuple[str, ...]) -> tuple[int, float]:
    """(optimizer steps, FLOPs per step) of a training run."""
    _, r = reference_recipe(experiment, list(overrides))
    cfg, model, batch = r.cfg, r.trainer.model, r.cfg.trainer.global_batch_size
    if cfg.trainer.name == "gpt":  # nanochat's estimate, the one its logged MFU uses
        return r.total_steps(), model.flops_per_token(cfg.data.seq_len) * r.tokens_per_step()
    if cfg.trainer.name == "dino":
        mc = cfg.trainer.multicrop

        def step(m, make):  # the student on every crop, the teacher on the global ones, the loss
            crops = [make(2, 3, mc.global_size, mc.global_size) for _ in mc.global_blur] + \
                    [make(2, 3, mc.local_size, mc.local_size) for _ in range(mc.local_crops)]
            m(crops, 0.04).backward()
        return r.total_steps(), counted(model, step) / 2 * batch
    return r.total_steps(), vit_flops(model, cfg.data.img_size) * batch


@lru_cache(maxsize=None)
def rates() -> dict[str, float]:
    """FLOP/s of one H200 per family: the measured runs, counted by the same rules."""
    from train.engine import PEAK_BF16_FLOPS

    _, vit = reference_recipe(VIT_RECORD["experiment"],
                              [f"model={VIT_RECORD['model']}", f"data.img_size={VIT_RECORD['img_size']}"])
    _, gpt = reference_recipe(GPT_RECORD["experiment"], [f"model={GPT_RECORD['model']}"])
    return {"vit": VIT_RECORD["images_per_s"] * vit_flops(vit.trainer.model, VIT_RECORD["img_size"]),
            "gpt": GPT_RECORD["tokens_per_s"] * gpt.trainer.model.flops_per_token(gpt.cfg.data.seq_len),
            "peak": PEAK_BF16_FLOPS["H200"]}


def select(df: pd.DataFrame, spec: str) -> pd.Series:
    """The rows matching "KEY=V,KEY=V...": every key must match, a key given twice either value."""
    want: dict[str, set[str]] = {}
    for word in (w for w in spec.split(",") if w):
        key, sep, value = word.partition("=")
        if not sep or key not in KEYS:
            raise ConfigError(f"--only {spec}: '{word}' is no KEY=VALUE with KEY one of {', '.join(KEYS)}")
        want.setdefault(key, set()).add(value)
    return df[list(want)].astype(str).isin(want).all(axis=1)


def stage_cost(name: str, stage: str, overrides: tuple[str, ...]) -> dict:
    """The cost of one run of a sweep's stage. Counted at the sweep's first k: the Laplacian heads'
    subtraction is no matmul, so every k costs the same FLOPs (tests/test_paper_runs.py)."""
    sweep = SWEEPS.loc[name]
    ov = (f"model={sweep.arch}_{sweep.k[0]}L", *sweep.extra, *overrides)
    if stage == "train":
        steps, flops = train_cost(sweep.experiment, ov)
    elif stage in EVALS:  # not counted (the module docstring)
        return dict(steps=None, flops_per_step=None, gpu_hours=None)
    else:  # a later stage of the chain (mid-training, SFT), initialised from the one before;
        # data.root= is the pre-training's there (slurm/chains/gpt_d20.sh)
        steps, flops = train_cost(stage, (ov[0], "trainer.init_from=x", *(o for o in ov[1:]
                                                                       if not o.startswith("data.root="))))
    return dict(steps=steps, flops_per_step=flops, gpu_hours=steps * flops / rates()[sweep.family] / 3600)


def runs(only: list[str] = (), overrides: list[str] = (), seeds: dict | None = None) -> pd.DataFrame:
    """The paper's runs matching any --only spec (all without one), one row each with its cost
    under `overrides`; `seeds`: another seed list per sweep name."""
    sweeps = SWEEPS.assign(seed=[(seeds or {}).get(name, s) for name, s in SWEEPS.seed.items()])
    # One row per sweep, stage, k and seed, in that order: the lists exploded into their product.
    df = sweeps.explode("stage").explode("k").explode("seed").reset_index()
    # A stage's experiment: the sweep's for training, the evaluation's module, else the stage's own.
    experiment = df.stage.map(EVALS).fillna(df.experiment.where(df.stage == "train", df.stage))
    df = df.assign(model=df.arch + "_" + df.k.astype(str) + "L", k=df.k.astype(int), seed=df.seed.astype(int),
                   experiment=experiment)[list(KEYS)]
    if only:
        df = df[pd.concat([select(df, spec) for spec in only], axis=1).any(axis=1)].reset_index(drop=True)
    if df.empty:
        raise ConfigError(f"--only {' --only '.join(only)}: no run of the paper matches (bash slurm/paper.sh --runs)")
    # Each sweep's stage is costed once: its runs differ only in k and seed.
    stages = df[["sweep", "stage"]].drop_duplicates()
    cost = pd.DataFrame([stage_cost(*key, tuple(overrides)) for key in stages.itertuples(index=False)])
    return df.merge(pd.concat([stages.reset_index(drop=True), cost], axis=1), on=["sweep", "stage"], how="left")


def markdown(df: pd.DataFrame, floatfmt: list[str]) -> str:
    """`df` as a Markdown table, an evaluation's uncounted costs (NaN) as empty cells."""
    return df.astype(object).where(df.notna(), None).to_markdown(index=False, floatfmt=floatfmt, missingval="")


def table(df: pd.DataFrame) -> str:
    """One row per sweep and stage as Markdown, then the total and the rates it assumes."""
    joined = lambda s: ",".join(map(str, sorted(set(s))))  # noqa: E731
    t = df.groupby(["sweep", "stage"], sort=False).agg(
        experiment=("experiment", "first"), k=("k", joined), seeds=("seed", joined), runs=("k", "size"),
        steps_per_run=("steps", "first"), tflop_per_step=("flops_per_step", "first"),
        h200_hours_per_run=("gpu_hours", "first"), h200_hours=("gpu_hours", lambda h: h.sum(min_count=1))).reset_index()
    t["tflop_per_step"] /= 1e12
    # Per column: whole steps, 4 significant TFLOPs, 3 for the hours of one run, one decimal for a
    # stage's; an evaluation's cells empty (not counted).
    md = markdown(t, [""] * 6 + [",.0f", ",.4g", ",.3g", ",.1f"])
    rt = rates()
    mfu = f"ViT {rt['vit'] / rt['peak']:.1%} (ViT-B/16, 224 px, 2,285 img/s eager), GPT {rt['gpt'] / rt['peak']:.1%}"
    return (f"{md}\n\nTotal: {len(df)} runs, {df.gpu_hours.sum():,.0f} H200-hours. H200 bf16 peak "
            f"{rt['peak'] / 1e12:.0f} TFLOP/s; MFU of the measured runs: {mfu} (d20, ~80 k tokens/s). "
            "Not counted: the evaluations, analysis and LM-benchmark jobs (minutes each).")


def submissions(df: pd.DataFrame, overrides: list[str], code_execution: bool) -> list[list[str]]:
    """The slurm/ commands of the selected runs: slurm/sweep.sh per DeiT-III model (its seeds);
    a chain script per GPT / DINO (model, seed), submitted whole when any of its stages is selected."""
    cmds = []
    for (name, model), runs_ in df.groupby(["sweep", "model"], sort=False):
        exp, extra, sbatch = SWEEPS.loc[name, ["experiment", "extra", "sbatch"]]
        if name.startswith("deit3"):
            seeds = ",".join(map(str, sorted(set(runs_.seed))))
            cmds.append(["bash", "slurm/sweep.sh", "--models", model, "--seeds", seeds, *sbatch, "--",
                         f"experiment={exp}", *extra, *overrides])
            continue
        script = "slurm/chains/gpt_d20.sh" if name == "gpt_d20" else "slurm/chains/dino.sh"
        # gpt_d20.sh names its stages' experiments itself; HumanEval runs only when asked.
        opt = ["--allow-code-execution"] if code_execution and name == "gpt_d20" else []
        experiment = [] if name == "gpt_d20" else [f"experiment={exp}"]
        for seed in dict.fromkeys(runs_.seed):  # in order, once each
            cmds.append(["bash", script, model, *opt, *sbatch, *experiment, f"seed={seed}", *extra, *overrides])
    return cmds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bash slurm/paper.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", default=[], metavar="KEY=V[,KEY=V...]",
                   help=f"the runs whose KEYs ({' '.join(KEYS)}) all match, a key given twice either value; "
                        f"repeated: the runs of any")
    p.add_argument("--seeds", action="append", default=[], metavar="SWEEP=0,1,2", help="another seed list for a sweep")
    p.add_argument("--runs", action="store_true", help="every run, one row each, instead of the table")
    p.add_argument("--submit", action="store_true", help="submit the selected runs (a dry run unless --no-dry-run)")
    p.add_argument("--no-dry-run", dest="dry_run", action="store_false", help="with --submit: really submit")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="the GPT chains' benchmarks include HumanEval (runs model-written code)")
    # After `--` (argparse: positional), Hydra overrides for every run and its cost.
    p.add_argument("overrides", nargs="*", metavar="-- OVERRIDE", help="Hydra overrides of every run")
    a = p.parse_args(argv)
    if a.submit and not a.dry_run and shutil.which("sbatch") is None:  # before the costs and the first job
        raise UserError("--no-dry-run: Slurm's sbatch is not on the PATH; submit from the cluster's login "
                        "node (or load its Slurm module), or leave out --no-dry-run to print the sbatch lines")
    seeds = {}
    for spec in a.seeds:
        name, _, values = spec.partition("=")
        if name not in SWEEPS.index or not values:
            raise ConfigError(f"--seeds {spec}: use SWEEP=0,1,... with SWEEP one of {', '.join(SWEEPS.index)}")
        seeds[name] = [int(v) for v in values.split(",")]
    df = runs(a.only, a.overrides, seeds)
    if a.runs:
        print(markdown(df.drop(columns="flops_per_step"), [""] * 6 + [",.0f", ",.3g"]))
        print(f"{len(df)} runs, {df.gpu_hours.sum():,.0f} H200-hours")
    else:
        print(table(df))
    if a.submit:
        # slurm/submit.sh prints the sbatch line instead of submitting under LAPLACE_DRY_RUN=1.
        env = {**os.environ, **({"LAPLACE_DRY_RUN": "1"} if a.dry_run else {})}
        for cmd in submissions(df, a.overrides, a.allow_code_execution):
            print("$ " + shlex.join(cmd), file=sys.stderr, flush=True)
            if rc := subprocess.run(cmd, cwd=ROOT, env=env, timeout=300).returncode:
                return rc  # the script said why, above: no traceback under it
    return 0


if __name__ == "__main__":
    sys.exit(cli_errors(main)())
