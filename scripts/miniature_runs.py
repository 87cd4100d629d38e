"""The miniature's profiles and their runs: which commands train, evaluate and measure each arm,
run a few at a time, resumably (scripts/miniature.py writes the report from them).

Three profiles, one recipe per paradigm for every k (never tuned per arm):
    short  ~25 min on 2 cores: DeiT-III and GPT, 300 steps each, 3 seeds (the smoke-sized look)
    long   ~2.5 h on 2 cores, two runs at a time on one thread each: DeiT-III, GPT and DINO trained
           until their validation metric flattens, 5 seeds; why each setting: the comments below
           and docs/LOG.md ("the long miniature: pilots")
    study  ~1.5 h on 2 cores, the same way: the paper's arms beside the baseline, ViTs with 64 tokens
           and QK-norm (a class-token and a mean-pooled head), 4 seeds (STUDY below; the report's
           claims and test: scripts/miniature_claims.py)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["trainer.num_workers=0", "trainer.progress=false", "trainer.log_every=25"]
LEARNED = ["model.laplacian_mode=learned"]

SHORT = {
    "deit3": dict(variants=[("vitt_0L", []), ("vitt_1L", []), ("vitt_3L", []), ("vitt_1L", LEARNED)],
                  args=["model.depth=4", "model.init_values=1.0", "trainer.max_steps=300",
                        "trainer.global_batch_size=64", "trainer.eval_every=100", "trainer.ckpt_every=100",
                        "optim.lr=1e-3", "optim.schedules.lr.warmup=20"], curve="val_acc1"),
    "gpt": dict(variants=[("gpt_d4_0L", []), ("gpt_d4_1L", []), ("gpt_d4_2L", []), ("gpt_d4_1L", LEARNED)],
                args=["experiment=gpt_pydoc", "data.seq_len=64", "trainer.global_batch_size=16",
                      "trainer.max_steps=300", "trainer.eval_every=100", "trainer.ckpt_every=100"], curve="val_bpb"),
}

# The long profile. Pilots (1 thread each, two or three runs sharing the 2 cores; LOG):
#  - deit3: the short recipe's val top-1 was 79.7 / 87.7 / 93.0 / 93.9 / 89.4 / 93.6 at steps
#    100..600 of a 1,200-step run (lr still high): flat from ~400 on; 400 steps, the cosine decay
#    ending with them. LayerScale 1.0 (not DeiT-III's 1e-6) so that the blocks act within a few
#    hundred steps (as in the short profile).
#  - gpt: Python's standard-library sources through our BPE (vocab 4,096; `python prepare.py
#    source=stdlib`, 6.9 M training tokens), Muon + AdamW (experiment=gpt_tiny's optimizers):
#    2.65 bits per byte after 50 steps of gpt_d4 (the short profile ends at 3.05 on bytes), but
#    1.4 s a step on one thread; gpt_d3 (192 wide, 2 heads of 96: the same arms 0 / 1 / 2, 2.9 M
#    parameters) at 16 x 128 tokens, ~0.8 s a step. 250 steps (the first 5-seed run, LOG) fell
#    0.28 bits per byte over its last 50 steps, and its val curve rose and fell at the same steps
#    in every run: the shards held whole files in path order, one file feeding tens of steps.
#    The stdlib source now writes 2,000-character pieces of the files in a fixed random order
#    (laplace.data.text.stdlib_documents; smooth curves since). 500 steps (1 M of the 6.9 M
#    training tokens; the last 20% nanochat's linear warm-down), the budget's limit.
#  - dino: experiment=dino_digits with DINO's teacher-temperature warm-up (0.04 -> 0.02 over the
#    first 60% of the epochs, as in the 50-epoch runs where 5 Laplacian heads led by 12-18 points;
#    0.02 from the start drifted towards uniform at that length), 20 epochs (440 steps, 0.5 s a
#    step on one thread; the 50-epoch pilot's loss was still falling at step 525): 20 runs of
#    1,100 steps do not fit the budget, nor did 30 epochs once the GPT's runs were timed. ViT-S's 6 heads:
#    k = 0 / 3 / 6, and 3 learned. 20-NN of the teacher at every kept checkpoint (the curve),
#    then `python -m eval.knn` and `python -m eval.linear` on the last one.
LONG = {
    "deit3": dict(variants=SHORT["deit3"]["variants"],
                  args=["model.depth=4", "model.init_values=1.0", "trainer.max_steps=400",
                        "trainer.global_batch_size=64", "trainer.eval_every=50", "trainer.ckpt_every=100",
                        "optim.lr=1e-3", "optim.schedules.lr.warmup=20"],
                  curve="val_acc1"),
    "gpt": dict(variants=[("gpt_d3_0L", []), ("gpt_d3_1L", []), ("gpt_d3_2L", []), ("gpt_d3_1L", LEARNED)],
                args=["experiment=gpt_tiny", "data=stdlib_bpe", "data.seq_len=128", "data.val_tokens=32768",
                      "trainer.global_batch_size=16", "trainer.max_steps=500", "trainer.eval_every=50",
                      "trainer.ckpt_every=250", "trainer.sample_prompts=[]"],
                curve="val_bpb", analysis=["max_tokens=131072"]),
    "dino": dict(variants=[("vits_0L", []), ("vits_3L", []), ("vits_6L", []), ("vits_3L", LEARNED)],
                 args=["experiment=dino_digits", "trainer.epochs=20", "trainer.ckpt_every=110", "trainer.keep_every=110",
                       "trainer.schedules.teacher_temp={value:0.02,warmup:12ep,start:0.04}"],
                 evals={"knn_digits": ["-m", "eval.knn", "num_workers=0"],      # <run>/eval/<name>
                        "linear_digits": ["-m", "eval.linear", "num_workers=0"]},
                 curve="knn"),
}
# The study profile (issue "the study measures what the paper claims"): the paper's arm per paradigm
# beside the baseline, the regime moved towards the authors' (pilots in docs/LOG.md, "the study"):
#  - deit3: 64 patch tokens per image (4 px patches of the 32 px upsampled digit, not 16), the
#    authors' QK-norm ViT (their timm fork builds every model with qk_norm=True), k = 0 / 1 / 3 of
#    3 heads (all-Laplacian: the paper's ViT-B-12L), LayerScale 1.0 as in the long profile. One
#    thread: 0.52 s a step, 400 steps as the long profile's (flat from ~400 there).
#  - gpt: the long profile's recipe, k = 0 / 1 of 2 only (the paper's best LM: 5 of 10 heads).
#  - dino: the long profile's recipe, k = 0 / 5 of 6 (the paper's best: ViT-S-5L).
# 4 seeds (what the session that first ran it could afford; --seeds 0 1 2 3 4 adds ~17 min), two runs at a time,
# seed by seed (a stopped study leaves whole seeds): ~75 min of training on 2 quiet cores.
STUDY_DEIT = dict(variants=[("vitt_0L", []), ("vitt_1L", []), ("vitt_3L", [])],
                  args=["model.depth=4", "model.init_values=1.0", "model.qk_norm=true", "data.patch_size=4",
                        "trainer.max_steps=400", "trainer.global_batch_size=64", "trainer.eval_every=50",
                        "trainer.ckpt_every=100", "optim.lr=1e-3", "optim.schedules.lr.warmup=20"],
                  curve="val_acc1")
STUDY = {
    "deit3": STUDY_DEIT,
    "gpt": dict(LONG["gpt"], variants=[("gpt_d3_0L", []), ("gpt_d3_1L", [])]),
    # The mean-pooled head (model.global_pool=avg): the class-token head reads norm(x)[:, 0] only,
    # so the last block's patch outputs get no gradient; here the loss reaches every patch token.
    "deit3_avg": dict(STUDY_DEIT, variants=[("vitt_0L", []), ("vitt_3L", [])],
                      args=STUDY_DEIT["args"] + ["model.global_pool=avg"]),
    "dino": dict(LONG["dino"], variants=[("vits_0L", []), ("vits_5L", [])]),
}
PROFILES = {
    "short": dict(recipes=SHORT, seeds=[0, 1, 2], jobs=1, out="runs/miniature", docs="docs/miniature", prepare=[]),
    "long": dict(recipes=LONG, seeds=[0, 1, 2, 3, 4], jobs=2, out="runs/miniature_long", docs="docs/miniature/long",
                 prepare=[["prepare.py", "source=stdlib", "vocab_size=4096", "progress=false"]]),
    "study": dict(recipes=STUDY, seeds=[0, 1, 2, 3], jobs=2, out="runs/miniature_study",
                  docs="docs/miniature/study",
                  prepare=[["prepare.py", "source=stdlib", "vocab_size=4096", "progress=false"]]),
}

_log_lock = threading.Lock()


def sh(cmd: list[str], log, env: dict | None = None, out_file: Path | None = None) -> str:
    """Run a command from the repository root, echo and log its line; its output goes to the
    log (or to out_file, when several run at once). Raises on failure."""
    line = "$ " + " ".join(cmd[1:] if cmd[0] == sys.executable else cmd)
    with _log_lock:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()
    if out_file is None:
        out = subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
        log.write(out)
        return out
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with open(out_file, "a") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, output=f"see {out_file}")
    return ""


def label(name: str, extra: list[str]) -> str:
    return name + ("_learned" if "model.laplacian_mode=learned" in extra else "")


def run_jobs(recipes: dict, out: Path, seeds, log, jobs: int = 1, steps: int | None = None,
             dry: bool = False) -> dict[str, list[Path]]:
    """Train (and evaluate) every (paradigm, variant, seed); {paradigm: run dirs}. Seed by seed,
    so that a stopped profile leaves whole seeds; `jobs` runs at a time, each on
    cpu_count // jobs threads. A finished run (results.json, and its evaluations' results) is
    skipped, an interrupted one resumes. `steps` shortens the recipes (a smoke test); `dry`
    only names the run dirs."""
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[Path]] = {}
    todo = []
    for seed in seeds:
        for paradigm, r in recipes.items():
            for name, extra in r["variants"]:
                run_dir = out / paradigm / f"{label(name, extra)}_s{seed}"
                runs.setdefault(paradigm, []).append(run_dir)
                short = [f"trainer.max_steps={steps}"] if steps else []
                cmds = [[sys.executable, "train.py", f"model={name}", f"seed={seed}", *r["args"], *extra, *COMMON,
                         *short, f"run_dir={run_dir}"]]
                evals = [(run_dir / "eval" / name, e) for name, e in r.get("evals", {}).items()]
                cmds += [[sys.executable, *e, f"checkpoint={run_dir / 'ckpt/last.pt'}", f"run_dir={d}"] for d, e in evals]
                todo.append((run_dir, cmds, [run_dir] + [d for d, _ in evals]))
    if dry:
        return runs
    env = None
    if jobs > 1:
        threads = str(max(1, (os.cpu_count() or 1) // jobs))
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}

    def one(run_dir: Path, cmds: list[list[str]], results: list[Path]):
        """Each command whose results.json (in the folder it writes) is not there yet."""
        out_file = out / "logs" / f"{run_dir.parent.name}_{run_dir.name}.log" if jobs > 1 else None
        done = [(d / "results.json").exists() for d in results]
        for cmd, finished in zip(cmds, done):
            if not finished:
                start = time.time()
                sh(cmd, log, env, out_file)
                with _log_lock, open(out / "timings.jsonl", "a") as f:  # the report's wall time
                    f.write(json.dumps({"run": f"{run_dir.parent.name}/{run_dir.name}", "command": cmd[1],
                                        "start": start, "end": time.time(), "threads": (env or {}).get(
                                            "OMP_NUM_THREADS")}) + "\n")

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for f in [pool.submit(one, *job) for job in todo]:
            f.result()  # the first failure stops the profile: runs not started are cancelled
    finally:
        pool.shutdown(cancel_futures=True)
    return runs


def analyse_all(runs: dict[str, list[Path]], log, recipes: dict | None = None):
    """One `python -m analysis` per paradigm over all its checkpoints (one process, shared axes),
    with the recipe's `analysis` arguments (the GPT's: the first 131,072 validation tokens)."""
    for paradigm, dirs in runs.items():
        extra = (recipes or {}).get(paradigm, {}).get("analysis", [])
        todo = [d for d in dirs if not (d / "ckpt/last_analysis/analysis.json").exists()]
        if todo:
            ckpts = ",".join(str(d / "ckpt/last.pt") for d in todo)
            sh([sys.executable, "-m", "analysis", f"checkpoint=[{ckpts}]", "layers=all", "progress=false", "figures=false",
                *extra, f"analysis_out={dirs[0].parent / 'compare'}"], log)
