"""CORE, DCLM's in-context tasks scored as nanochat scores them (`nanochat/core_eval.py` and
`scripts/base_eval.py` at 92d63d4): each task's accuracy centred by its random baseline,
(acc - b) / (1 - b), and CORE their mean. The command is `python -m eval.core`; training runs it
with trainer.core_metric_every.

    res = evaluate(model, tokenizer, ensure_bundle("data/eval_bundle"), max_per_task=500)
    res["core_metric"], res["results"]["hellaswag_zeroshot"], res["centered_results"][...]

A bundle is nanochat's eval_bundle folder: core.yaml (the tasks), eval_meta_data.csv (random
baselines, in %) and eval_data/*.jsonl.
"""
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
import yaml
from torch.nn.utils.rnn import pad_sequence

from .errors import UserError

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's


def ensure_bundle(path) -> Path:
    """The bundle folder at `path`; where nothing is there, downloaded from nanochat's URL (rank 0)."""
    path, why = Path(path).expanduser(), ""
    if not path.exists() and _ranks()[0] == 0:
        try:
            with tempfile.TemporaryDirectory(dir=path.parent if path.parent.is_dir() else None) as tmp:
                torch.hub.download_url_to_file(BUNDLE_URL, f"{tmp}/bundle.zip")
                shutil.unpack_archive(f"{tmp}/bundle.zip", tmp)
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(f"{tmp}/eval_bundle", path)  # the zip's one folder
        except OSError as e:  # no network (URLError is an OSError), or a read-only place
            why = f" and it could not be downloaded ({type(e).__name__}: {str(e)[:80]})"
    if torch.distributed.is_initialized():  # the others wait for rank 0's download
        torch.distributed.barrier()
    if not (path / "core.yaml").is_file():  # every rank says so, none waits for another
        raise UserError(f"bundle={path}: no CORE eval bundle (core.yaml) there{why}; fetch {BUNDLE_URL} "
                        f"where there is a network, unzip it and pass bundle=<its eval_bundle folder>")
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


@torch.no_grad()
def score_example(model, tokenizer, data: list[dict], idx: int, meta: dict) -> bool:
    """Whether the model gets example `idx` right (nanochat's evaluate_example)."""
    item, kind, k = data[idx], meta["task_type"], meta["num_fewshot"]
    # nanochat's few-shot draw: seeded by the example's position, never the example itself
    others = [i for i in range(len(data)) if i != idx]
    shots = [data[i] for i in random.Random(1234 + idx).sample(others, k)] if k else []
    seqs = [tokenizer.encode(p, prepend_bos=True) for p in render(item, kind, meta["continuation_delimiter"], shots)]
    if kind == "multiple_choice":  # the choices follow a shared context
        spans = [(len(os.path.commonprefix(seqs)), len(s)) for s in seqs]  # (commonprefix takes lists too)
    elif kind == "schema":  # the contexts precede a shared continuation
        suffix = len(os.path.commonprefix([s[::-1] for s in seqs]))
        spans = [(len(s) - suffix, len(s)) for s in seqs]
    else:  # one sequence: the prompt with its continuation
        assert seqs[1][:len(seqs[0])] == seqs[0], "the prompt without the continuation must prefix the one with it"
        seqs, spans = seqs[1:], [(len(seqs[0]), len(seqs[1]))]
    limit = getattr(model, "max_seq_len", None)  # as nanochat: keep the last tokens of a longer sequence
    if limit:
        spans = [(a - max(0, len(s) - limit), b - max(0, len(s) - limit)) for s, (a, b) in zip(seqs, spans)]
        seqs = [s[-limit:] for s in seqs]
    ids = pad_sequence([torch.tensor(s) for s in seqs], batch_first=True,  # BOS pads on the right
                       padding_value=tokenizer.bos_id).to(next(model.parameters()).device)
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
