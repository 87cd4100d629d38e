"""`python -m eval.core`: the CORE metric (DCLM's in-context tasks) as nanochat computes it.

    python -m eval.core checkpoint=runs/gpt/<data>/<run>/ckpt/last.pt              # the bundle in data/eval_bundle
    python -m eval.core checkpoint=... bundle=/data/eval_bundle max_per_task=500  # nanochat's in-training setting
    torchrun --nproc_per_node=8 -m eval.core checkpoint=...                       # ranks share the examples

The scoring is laplace/core_eval.py (nanochat's); a missing bundle is downloaded from nanochat's URL.
Output: the per-task table, and results.json + core.md in <run>/eval/core[_max<N>]/. Defaults: configs/core.yaml.
"""
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from laplace.checkpoint import run_dir_of
from train.rundir import results_header
from train.cli import hydra_entry
from train.config import required
from laplace.core_eval import ensure_bundle, evaluate
from laplace.io import atomic_write, write_json


def evaluate_core(cfg: DictConfig) -> dict:
    """Run the command: print the per-task table, write results.json and core.md beside the run."""
    from train import dist

    from .generate import load_gpt

    checkpoint = required(cfg, "checkpoint", "python -m eval.core checkpoint=PATH [bundle=DIR]")
    info = dist.setup(str(cfg.device))
    bundle = ensure_bundle(cfg.bundle)  # before the model: offline without a bundle fails at once
    model, tok, src = load_gpt(checkpoint, info.device)
    main = info.rank == 0
    res = evaluate(model, tok, bundle, int(cfg.max_per_task), log=print if main else None)
    path = src["path"]
    tag = "core" if cfg.max_per_task <= 0 else f"core_max{cfg.max_per_task}"
    out = Path(cfg.out).expanduser() if cfg.out else run_dir_of(path) / "eval" / tag
    if main:
        # one row per task (accuracy, centred) and a last row with CORE
        df = pd.DataFrame({"accuracy": res["results"], "centered": res["centered_results"]}).rename_axis("task")
        df.loc["CORE"] = [None, res["core_metric"]]
        md = df.to_markdown(floatfmt=".4f")
        print(f"[core] {path} (step {src['step']})\n{md}\n[core] wrote {out / 'results.json'}", flush=True)
        atomic_write(out / "core.md", (md + "\n").encode())
        write_json(out / "results.json", {**results_header(src["node"], src["dataset"], path, step=src["step"]),
                                          "evaluation": "core", "bundle": str(bundle),
                                          "max_per_task": int(cfg.max_per_task), **res})
    dist.cleanup()
    return res


main = hydra_entry("core")(evaluate_core)


if __name__ == "__main__":
    main()
