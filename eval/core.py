"""`python -m eval.core`: the CORE metric (DCLM's in-context tasks) as nanochat computes it.

    python -m eval.core checkpoint=runs/gpt/<data>/<run>/ckpt/last.pt              # the bundle in data/eval_bundle
    python -m eval.core checkpoint=... bundle=/data/eval_bundle max_per_task=500  # nanochat's in-training setting
    torchrun --nproc_per_node=8 -m eval.core checkpoint=...                       # ranks share the examples

Each task's accuracy is centred by its random baseline, (acc - b) / (1 - b), and CORE is their mean
(nanochat's `scripts/base_eval.py`, `nanochat/core_eval.py` at 92d63d4). The bundle is nanochat's
eval_bundle folder: core.yaml (the tasks), eval_meta_data.csv (random baselines, in %) and
eval_data/*.jsonl; where it is missing it is downloaded from nanochat's URL. Defaults: configs/core.yaml.
"""
from __future__ import annotations

import json
import random
import shutil
import tempfile
import zipfile
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
import yaml
from omegaconf import DictConfig

from laplace.checkpoint import results_header, run_dir_of
from laplace.cli import hydra_entry
from laplace.config import required
from laplace.errors import UserError
from laplace.io import atomic_write, write_json

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's


def ensure_bundle(path) -> Path:
    """The bundle folder at `path`, downloaded there from nanochat's URL (rank 0) if it is missing."""
    path = Path(path).expanduser()
    if not (path / "core.yaml").is_file() and _ranks()[0] == 0:
        try:
            with tempfile.TemporaryDirectory(dir=path.parent if path.parent.is_dir() else None) as tmp:
                torch.hub.download_url_to_file(BUNDLE_URL, f"{tmp}/bundle.zip")
                zipfile.ZipFile(f"{tmp}/bundle.zip").extractall(tmp)
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(f"{tmp}/eval_bundle", path)  # the zip's one folder
        except OSError as e:  # no network (URLError is an OSError), or a read-only place
            raise UserError(f"bundle={path}: no CORE eval bundle there and it could not be downloaded "
                            f"({type(e).__name__}: {str(e)[:80]}); fetch {BUNDLE_URL} where there is a network, "
                            f"unzip it and pass bundle=<its eval_bundle folder>") from None
    if torch.distributed.is_initialized():  # the others wait for rank 0's download
        torch.distributed.barrier()
    return path


def _ranks() -> tuple[int, int]:
    d = torch.distributed
    return (d.get_rank(), d.get_world_size()) if d.is_initialized() else (0, 1)


def render(item: dict, kind: str, delim: str, shots: list[dict]) -> list[str]:
    """The prompts of one example: one per choice (multiple choice), per context (schema), or the
    context without then with the continuation (language modelling). These f-strings give the same
    text as nanochat's jinja2 templates (tests/test_core.py runs both)."""
    if kind == "multiple_choice":
        head = "".join(f"{s['query']}{delim}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{item['query']}{delim}{c}" for c in item["choices"]]
    if kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{delim}{s['continuation']}\n\n" for s in shots)
        return [f"{head}{c}{delim}{item['continuation']}" for c in item["context_options"]]
    if kind == "language_modeling":  # contexts are trimmed: some end in spaces the continuation would absorb
        head = "".join(f"{s['context'].strip()}{delim}{s['continuation']}\n\n" for s in shots)
        prompt = f"{head}{item['context'].strip()}{delim}"
        return [prompt.strip(), prompt + item["continuation"]]
    raise UserError(f"core.yaml: icl_task_type {kind!r} is not one of multiple_choice, schema, language_modeling")


def _common(seqs: list[list[int]], reverse: bool = False) -> int:
    """The length of the token prefix (or suffix) all sequences share."""
    n = 0
    for col in zip(*(s[::-1] if reverse else s for s in seqs)):
        if len(set(col)) > 1:
            break
        n += 1
    return n


@torch.no_grad()
def score_example(model, tokenizer, data: list[dict], idx: int, meta: dict) -> bool:
    """Whether the model gets example `idx` right (nanochat's evaluate_example)."""
    item, kind, k = data[idx], meta["task_type"], meta["num_fewshot"]
    # nanochat's few-shot draw: seeded by the example's position, never the example itself
    shots = [data[i] for i in random.Random(1234 + idx).sample([i for i in range(len(data)) if i != idx], k)] if k else []
    seqs = [tokenizer.encode(p, prepend_bos=True) for p in render(item, kind, meta["continuation_delimiter"], shots)]
    if kind == "multiple_choice":  # the choices follow a shared context
        spans = [(_common(seqs), len(s)) for s in seqs]
    elif kind == "schema":  # the contexts precede a shared continuation
        spans = [(len(s) - _common(seqs, reverse=True), len(s)) for s in seqs]
    else:  # one sequence: the prompt with its continuation
        assert seqs[1][:len(seqs[0])] == seqs[0], "the prompt without the continuation must prefix the one with it"
        seqs, spans = seqs[1:], [(len(seqs[0]), len(seqs[1]))]
    limit = getattr(model, "max_seq_len", None)  # as nanochat: keep the last tokens of a longer sequence
    if limit:
        spans = [(a - max(0, len(s) - limit), b - max(0, len(s) - limit)) for s, (a, b) in zip(seqs, spans)]
        seqs = [s[-limit:] for s in seqs]
    device = next(model.parameters()).device
    ids = torch.full((len(seqs), max(map(len, seqs))), tokenizer.bos_id, dtype=torch.long)  # BOS pads on the right
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    ids = ids.to(device)
    logits = model(ids)
    # every position's loss against the next token, as nanochat computes it (same reductions, same ties)
    losses = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, dims=1).flatten(), reduction="none").view(ids.shape)
    if kind == "language_modeling":  # right when greedy decoding reproduces the continuation
        a, b = spans[0]
        return bool((logits[0, a - 1:b - 1].argmax(-1) == ids[0, a:b]).all())
    mean = [losses[i, a - 1:b - 1].mean().item() for i, (a, b) in enumerate(spans)]
    return mean.index(min(mean)) == item["gold"]


def evaluate(model, tokenizer, bundle, max_per_task: int = -1, log=None) -> dict:
    """CORE on `bundle` (a folder in nanochat's layout): {results, centered_results, core_metric},
    per task label. Under torch.distributed every rank scores every world_size-th example."""
    bundle = Path(bundle)
    tasks = yaml.safe_load((bundle / "core.yaml").read_text(encoding="utf-8"))["icl_tasks"]
    baselines = pd.read_csv(bundle / "eval_meta_data.csv").set_index("Eval Task")["Random baseline"]
    rank, world = _ranks()
    out = {"results": {}, "centered_results": {}}
    for task in tasks:
        label = task["label"]
        meta = {"task_type": task["icl_task_type"], "num_fewshot": task["num_fewshot"][0],
                "continuation_delimiter": task.get("continuation_delimiter", " ")}
        with open(bundle / "eval_data" / task["dataset_uri"], encoding="utf-8") as f:
            data = [json.loads(line) for line in f]
        random.Random(1337).shuffle(data)  # nanochat's fixed order, so max_per_task takes the same subset
        data = data[:max_per_task] if max_per_task > 0 else data
        correct = torch.zeros(len(data), device=next(model.parameters()).device)
        for i in range(rank, len(data), world):
            correct[i] = float(score_example(model, tokenizer, data, i, meta))
        if world > 1:
            torch.distributed.all_reduce(correct)
        acc = correct.mean().item()
        b = 0.01 * float(baselines[label])
        out["results"][label], out["centered_results"][label] = acc, (acc - b) / (1 - b)
        if log:
            log(f"[core] {label}: accuracy {acc:.4f}, centred {(acc - b) / (1 - b):.4f}")
    out["core_metric"] = sum(out["centered_results"].values()) / len(out["centered_results"])
    return out


def table(res: dict) -> pd.DataFrame:
    """One row per task (accuracy, centred) and a last row with CORE."""
    df = pd.DataFrame({"accuracy": res["results"], "centered": res["centered_results"]})
    df.loc["CORE"] = [None, res["core_metric"]]
    return df.rename_axis("task")


def evaluate_core(cfg: DictConfig) -> dict:
    """Run the command: print the per-task table, write results.json and core.md beside the run."""
    from laplace import dist

    from .generate import load_gpt

    checkpoint = required(cfg, "checkpoint", "python -m eval.core checkpoint=PATH [bundle=DIR]")
    info = dist.setup(str(cfg.device))
    bundle = ensure_bundle(cfg.bundle)  # before the model: offline without a bundle fails at once
    model, tok, src = load_gpt(checkpoint, info.device)
    main = info.rank == 0
    res = evaluate(model, tok, bundle, int(cfg.max_per_task), log=print if main else None)
    path = src["path"]
    tag = "core" if cfg.max_per_task <= 0 else f"core_max{cfg.max_per_task}"
    out = Path(cfg.out).expanduser() if cfg.out else (path if path.is_dir() else run_dir_of(path)) / "eval" / tag
    if main:
        md = table(res).to_markdown(floatfmt=".4f")
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
