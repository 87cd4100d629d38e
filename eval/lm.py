"""`python -m eval.lm`: language-model benchmarks of GPT checkpoints with lm-evaluation-harness.

    python -m eval.lm checkpoint=runs/gpt/<data>/<run>/ckpt/last.pt tasks=[laplace_chat] allow_code_execution=true
    python -m eval.lm checkpoint=... tasks=[arc_easy,arc_challenge,mmlu]          # lm-eval's own tasks
    python -m eval.lm checkpoint=[A.pt,B.pt] tasks=[laplace_chat] data_root=/data/hf allow_code_execution=true
    python -m eval.lm checkpoint=... tasks=[laplace_chat_arc_easy] limit=20      # a smoke test

Every default lives in configs/lm_eval.yaml. The model is the `laplace` lm-eval adapter
(eval/lm_adapter.py: the checkpoint's GPT and tokenizer); tasks are lm-eval's own plus those in
eval/tasks (`laplace_chat`: the paper's protocol, nanochat's zero-shot chat evaluation of an
SFT model on ARC-Easy, ARC-Challenge, MMLU, GSM8K and HumanEval, whose `acc` is the unweighted
mean of the five, the paper's "average"; eval/tasks/laplace_chat/utils.py).

For each checkpoint it prints a table (task, metric, value, stderr, n) and writes results.json
atomically, by default to `<the checkpoint's run>/eval/lm_<tasks tag>/results.json`, where
`python -m analysis.tables` finds it with the run. The file holds the run's shared fields
(model, num_laplacian_heads, laplacian_mode, dataset, checkpoint, step), `lm_eval_version`,
`tasks: {task: {version, n, num_fewshot, metrics: {metric: {value, stderr}}}}` and flat
`"<task>/<metric>": value` keys (`laplace_chat/acc`, `laplace_chat_gsm8k/acc`, `arc_easy/acc`,
`gsm8k/exact_match`, ...). A metric computed under a filter other than lm-eval's "none" is
keyed `<metric>,<filter>`, and the task's first filter's value also plain `<metric>`
(gsm8k/exact_match = strict-match).

HumanEval (ours or lm-eval's) runs model-written code on this machine: it needs
allow_code_execution=true (which sets lm-eval's confirm_run_unsafe_code, our
LAPLACE_ALLOW_CODE_EXECUTION=1 and HF_ALLOW_CODE_EVAL=1 for this run only); without it the
command refuses before loading a model. Bad input (missing checkpoint, unknown task,
humaneval without the flag, missing data) exits with one `error: ...` line.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig, ListConfig

from laplace.checkpoint import load_checkpoint, results_header, run_dir_of
from laplace.cli import hydra_entry
from laplace.config import required_list
from laplace.errors import ConfigError
from laplace.io import atomic_write, write_json
from laplace.rundir import MAX_NAME, check_writable, short_name
from train.logger import log_to_training_run

TASKS_DIR = Path(__file__).resolve().with_name("tasks")
STANDARD_TASKS = ("arc_easy", "arc_challenge", "mmlu", "gsm8k", "humaneval")
CODE_ENV = ("LAPLACE_ALLOW_CODE_EXECUTION", "HF_ALLOW_CODE_EVAL")


# ------------------------------------------------------------------------------------- inputs

def checkpoints(cfg) -> list[Path]:
    """The checkpoint files (one path or a list); a missing one is a one-line error."""
    values = required_list(cfg, "checkpoint", "python -m eval.lm checkpoint=PATH tasks=[laplace_chat]")
    if not values:
        raise ConfigError("checkpoint=[]: give at least one checkpoint")
    paths = []
    for v in values:
        p = Path(os.path.expanduser(str(v)))
        if not p.is_file():
            raise ConfigError(f"checkpoint={v}: no such file; pass a GPT's laplace checkpoint, e.g. "
                              f"runs/gpt/<data>/<run>/ckpt/last.pt")
        paths.append(p)
    return paths


def task_names(cfg) -> list[str]:
    tasks = cfg.tasks
    names = [str(t) for t in tasks] if isinstance(tasks, (list, tuple, ListConfig)) else \
        [t.strip() for t in str(tasks).split(",")]
    names = [n for n in names if n]
    if not names:
        raise ConfigError("tasks=[]: name at least one task, e.g. tasks=[laplace_chat]")
    return names


def task_manager(names: list[str], data_root: str | None = None):
    """An lm-eval TaskManager that knows eval/tasks and, unless every name is one of ours,
    lm-eval's built-in tasks (indexing those takes seconds). An unknown name is a one-line
    error listing close ones."""
    data_root = None if data_root is None else str(data_root)
    tm = _task_manager(False, data_root)
    if not all(n in tm.task_index for n in names):
        tm = _task_manager(True, data_root)
    for n in names:
        if n not in tm.task_index:
            close = difflib.get_close_matches(n, tm.all_tasks, n=5, cutoff=0.6)
            if not close:  # e.g. "arc": names that contain it
                close = [t for t in tm.all_tasks if n.lower() in t.lower()][:5]
            hint = f"close: {', '.join(close)}" if close else "see `lm_eval ls tasks` and eval/tasks"
            raise ConfigError(f"tasks: unknown task {n!r} ({hint})")
    return tm


@functools.lru_cache(maxsize=4)
def _task_manager(include_defaults: bool, data_root: str | None):
    """One TaskManager per setting and process: indexing lm-eval's ~15k built-in tasks takes seconds."""
    from lm_eval.tasks import TaskManager

    meta = {"data_root": data_root} if data_root else None
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults, metadata=meta)


def unsafe_tasks(tm, names: Iterable[str]) -> list[str]:
    """The tasks among `names` (groups and tags expanded) that execute generated code
    (`unsafe_code: true`), read from the index without building any task."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    found, seen = [], set()

    def visit(item, inherited: bool = False):
        if isinstance(item, dict):  # a group's member with overrides
            unsafe = inherited or bool(item.get("unsafe_code"))
            if "group" in item and item["group"] not in tm.task_index:  # an inline group
                for child in item.get("task") or []:
                    visit(child, unsafe)
                return
            name = item.get("task") or item.get("group")
            if unsafe and name:
                found.append(str(name))
            if name:
                visit(str(name), unsafe)
            return
        name = str(item)
        if name in seen:
            return
        seen.add(name)
        entry = tm.task_index.get(name)
        if entry is None:
            return
        if entry.kind == Kind.TAG:
            for t in sorted(entry.tags):
                visit(t, inherited)
            return
        cfg = entry.cfg if entry.cfg is not None else (load_yaml(entry.yaml_path, resolve_func=False)
                                                        if entry.yaml_path else {})
        if entry.kind == Kind.GROUP:
            for child in cfg.get("task") or []:
                visit(child, inherited or bool(cfg.get("unsafe_code")))
        elif inherited or cfg.get("unsafe_code"):
            found.append(name)

    for n in names:
        visit(n)
    return sorted(set(found))


def check_code_eval_metric(tasks: list[str]) -> None:
    """lm-eval's own humaneval scores with `evaluate`'s code_eval metric, a script fetched from
    the hub on first use: offline without it cached, say so in one line before any model work."""
    try:
        import evaluate

        with code_execution(True):
            evaluate.load("code_eval")
    except Exception as e:  # noqa: BLE001 -- FileNotFoundError / ConnectionError offline, ImportError without evaluate
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConfigError(f"tasks {', '.join(tasks)} score with the `evaluate` library's code_eval metric, "
                          f"which cannot be loaded here ({first}); load it once online "
                          f"(python -c \"import evaluate; evaluate.load('code_eval')\") or use "
                          f"laplace_chat_humaneval, which needs nothing more") from None


def tasks_tag(cfg, names: list[str]) -> str:
    """`lm_<tasks>` naming an evaluation: the task names (`standard` for the default five),
    then the settings that change the numbers (shots, chat template, limit)."""
    tag = "standard" if tuple(names) == STANDARD_TASKS else "+".join(names)
    if cfg.num_fewshot is not None:
        tag += f"_{int(cfg.num_fewshot)}shot"
    if cfg.apply_chat_template:
        tag += "_chat"
    if cfg.limit is not None:
        tag += f"_limit{cfg.limit:g}" if isinstance(cfg.limit, float) else f"_limit{cfg.limit}"
    return f"lm_{tag}"


def out_dirs(cfg, paths: list[Path], names: list[str]) -> list[Path]:
    """Where each checkpoint's results.json goes (see `out` in configs/lm_eval.yaml)."""
    tag = tasks_tag(cfg, names)
    if cfg.out is None:  # many tasks make a long tag: bounded like a run directory's name
        dirs = [run_dir_of(p) / "eval" / short_name(tag if p.stem == "last" else f"{tag}_{p.stem}", MAX_NAME)
                for p in paths]
    elif len(paths) == 1:
        dirs = [Path(os.path.expanduser(str(cfg.out)))]
    else:
        base = Path(os.path.expanduser(str(cfg.out)))
        dirs = [base / (run_dir_of(p).name if p.stem == "last" else f"{run_dir_of(p).name}_{p.stem}") for p in paths]
    seen: dict[Path, Path] = {}
    for d, p in zip(dirs, paths):
        if d in seen:
            raise ConfigError(f"checkpoint: {seen[d]} and {p} would both write {d}/results.json; "
                              f"evaluate them in separate calls with out=DIR")
        seen[d] = p
    return dirs


# ------------------------------------------------------------------------------------- results

def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def summarize(res: dict) -> tuple[dict, dict, list[tuple]]:
    """lm-eval's results -> (per task {version, n, num_fewshot, metrics: {metric: {value,
    stderr}}}, flat {"task/metric": value}, table rows (task, metric, value, stderr, n))."""
    tasks, flat, rows = {}, {}, []
    n_samples = res.get("n-samples", {})
    children = res.get("group_subtasks", {})

    def n_of(name):
        if name in n_samples:
            return int(n_samples[name].get("effective", n_samples[name].get("original", 0)))
        if children.get(name):
            return sum(n_of(c) for c in children[name])
        return res["results"].get(name, {}).get("sample_len")

    for name, block in res.get("results", {}).items():
        metrics, first_filter = {}, {}
        for key, value in block.items():
            if "," not in key or "_stderr," in key or key.startswith("sample_"):
                continue
            metric, filt = key.split(",", 1)
            v = _number(value)
            if v is None:
                continue
            stderr = _number(block.get(f"{metric}_stderr,{filt}"))
            label = metric if filt == "none" else f"{metric},{filt}"
            metrics[label] = {"value": v, "stderr": stderr}
            first_filter.setdefault(metric, label)
        n = n_of(name)
        tasks[name] = {"version": res.get("versions", {}).get(name), "n": n,
                       "num_fewshot": res.get("n-shot", {}).get(name), "metrics": metrics}
        for label, m in metrics.items():
            flat[f"{name}/{label}"] = m["value"]
            rows.append((name, label, m["value"], m["stderr"], n))
        for metric, label in first_filter.items():  # the plain name: the first filter's value
            flat.setdefault(f"{name}/{metric}", metrics[label]["value"])
    return tasks, flat, rows


def format_table(rows: list[tuple], title: str) -> str:
    head = ("task", "metric", "value", "stderr", "n")
    body = [(t, m, f"{v:.4f}", "-" if s is None else f"{s:.4f}", "" if n is None else str(n)) for t, m, v, s, n in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(5)]
    line = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([title, line(head), line(tuple("-" * w for w in widths)), *map(line, body)])


def checkpoint_fields(path: Path) -> dict:
    """The fields every results.json shares (`laplace.checkpoint.results_header`), from the checkpoint."""
    ckpt = load_checkpoint(path)
    config = ckpt.get("config") or {}
    m, data = config.get("model") or {}, config.get("data") or {}
    if "embed_dim" in m or not str(m.get("name", "")).startswith("gpt"):
        raise ConfigError(f"checkpoint={path} holds {m.get('name')}, not a GPT: lm-eval needs a language model")
    return results_header(m, data.get("name"), path, step=(ckpt.get("loop") or {}).get("step"))




@contextlib.contextmanager
def code_execution(allowed: bool):
    """The environment flags that let HumanEval run code, set for this run only."""
    saved = {k: os.environ.get(k) for k in CODE_ENV}
    try:
        for k in CODE_ENV:
            if allowed:
                os.environ[k] = "1"
            else:
                os.environ.pop(k, None)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _offline_data_errors():
    """lm-eval's own tasks read the hub through `datasets`: unreachable (offline, no cache) is
    the user's to fix, in one line."""
    try:
        yield
    except ConnectionError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{first}: lm-eval's tasks read their hub datasets through `datasets`; offline, "
                          f"fill the HF cache first (HF_DATASETS_OFFLINE=1 then reads it), or use the "
                          f"laplace_chat tasks with data_root=DIR") from None


class _QuietCustomDataset(logging.Filter):
    """Drops lm-eval's warning, once per task with a custom_dataset, about passing --metadata."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


# ------------------------------------------------------------------------------------- command

def evaluate_lm(cfg: DictConfig, stdout=None) -> list[dict]:
    """Run the command: every checkpoint on every task; returns the records written."""
    out = stdout or sys.stdout
    paths, names = checkpoints(cfg), task_names(cfg)
    tm = task_manager(names, cfg.data_root)
    code_tasks = unsafe_tasks(tm, names)
    if code_tasks and not cfg.allow_code_execution:
        raise ConfigError(f"tasks {', '.join(code_tasks)} run model-generated code on this machine: pass "
                          f"allow_code_execution=true, or leave them out of tasks=[...]")
    foreign = [t for t in code_tasks if not str(tm.task_index[t].yaml_path or "").startswith(str(TASKS_DIR))]
    if foreign:
        check_code_eval_metric(foreign)
    ours = [n for n in names if n in tm.task_index and str(tm.task_index[n].yaml_path or "").startswith(str(TASKS_DIR))]
    if cfg.apply_chat_template and ours:
        raise ConfigError(f"apply_chat_template=true with {', '.join(ours)}: those tasks render our chat "
                          f"format themselves; use apply_chat_template=false")
    dirs = out_dirs(cfg, paths, names)
    fields = [checkpoint_fields(p) for p in paths]  # every checkpoint checked before any evaluation
    for d in dirs:  # and every output folder: results are written after hours of evaluation
        check_writable(d, "out")

    import lm_eval

    import eval.lm_adapter  # noqa: F401  registers the "laplace" model

    task_log = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _QuietCustomDataset) for f in task_log.filters):
        task_log.addFilter(_QuietCustomDataset())

    gen_kwargs = {"max_gen_toks": int(cfg.max_gen_toks)} if cfg.max_gen_toks is not None else None
    seeds = {} if cfg.seed is None else {k: int(cfg.seed) for k in (
        "random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")}
    limit = cfg.limit
    records = []
    for path, d, shared in zip(paths, dirs, fields):
        t0 = time.time()
        with code_execution(bool(cfg.allow_code_execution)), _offline_data_errors():
            res = lm_eval.simple_evaluate(
                model="laplace", model_args={"checkpoint": str(path), "dtype": str(cfg.dtype)},
                tasks=list(names), num_fewshot=cfg.num_fewshot, batch_size=int(cfg.batch_size),
                device=str(cfg.device), limit=limit, bootstrap_iters=int(cfg.bootstrap_iters),
                apply_chat_template=bool(cfg.apply_chat_template), gen_kwargs=gen_kwargs,
                task_manager=tm, confirm_run_unsafe_code=bool(cfg.allow_code_execution),
                log_samples=bool(cfg.log_samples), **seeds)
        tasks, flat, rows = summarize(res)
        record = {**shared, "evaluation": "lm_eval", "lm_eval_version": res.get("lm_eval_version"),
                  "tasks_requested": list(names), "num_fewshot": cfg.num_fewshot, "limit": limit,
                  "apply_chat_template": bool(cfg.apply_chat_template),
                  "data_root": None if cfg.data_root is None else str(cfg.data_root),
                  "seconds": round(time.time() - t0, 1), "tasks": tasks, **flat}
        results_path = d / "results.json"
        if cfg.log_samples:
            for task, samples in (res.get("samples") or {}).items():
                lines = "".join(json.dumps(s, default=str) + "\n" for s in samples)
                atomic_write(d / f"samples_{task}.jsonl", lines.encode())
        write_json(results_path, record)
        out.write(format_table(rows, f"[lm_eval] {path} (step {shared['step']})") + "\n")
        out.write(f"[lm_eval] wrote {results_path}\n")
        out.flush()
        log_to_training_run(path, flat, "lm")  # "lm/<task>/<metric>", when the GPT's run used W&B
        records.append(record)
    return records


main = hydra_entry("lm_eval")(evaluate_lm)


if __name__ == "__main__":
    main()
