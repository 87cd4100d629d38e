"""`python -m eval.lm`: language-model benchmarks of GPTs with lm-evaluation-harness.

    python -m eval.lm checkpoint=runs/gpt/<data>/<run>/ckpt/last.pt tasks=[laplace_chat] allow_code_execution=true
    python -m eval.lm checkpoint=exports/gpt_d20 tasks=[laplace_pydoc]           # an exported folder
    python -m eval.lm checkpoint=... tasks=[arc_easy,arc_challenge,mmlu]          # lm-eval's own tasks
    python -m eval.lm checkpoint=[A.pt,B.pt] tasks=[laplace_chat] data_root=/data/hf allow_code_execution=true
    python -m eval.lm checkpoint=... tasks=[laplace_chat_arc_easy] limit=20      # a smoke test

Defaults: configs/lm_eval.yaml. The model is the `laplace` adapter (eval/lm_adapter.py); the tasks
are lm-eval's own and those of eval/tasks (laplace_chat: the paper's protocol; laplace_pydoc: no
data to download). Each checkpoint gets lm-eval's table and a results.json, by default in
`<the checkpoint's run>/eval/lm_<tasks tag>/` (an exported folder: `<folder>/eval/...`), where
`python -m analysis.tables` finds it: the run's shared fields, `tasks: {task: {version, n,
num_fewshot, metrics: {metric: {value, stderr}}}}` and flat `"<task>/<metric>": value` keys.
"""
import difflib
import functools
import logging
import math
import os
import time
from pathlib import Path
from unittest import mock

from omegaconf import DictConfig

from laplace.checkpoint import run_dir_of
from train.cli import hydra_entry
from train.config import required_list
from laplace.errors import ConfigError, one_line
from laplace.io import write_json
from train.rundir import MAX_NAME, check_writable, results_header, short_name
from train.logger import log_to_training_run

from .generate import gpt_source

TASKS_DIR = Path(__file__).resolve().with_name("tasks")
STANDARD_TASKS = ("arc_easy", "arc_challenge", "mmlu", "gsm8k", "humaneval")
CODE_ENV = ("LAPLACE_ALLOW_CODE_EXECUTION", "HF_ALLOW_CODE_EVAL")  # ours (eval/tasks), HF evaluate's
# ChatCORE (nanochat's scripts/chat_eval.py): laplace_chat's accuracies centred by these chance levels, then
# averaged. The fork's lora_eval adds SpellingBee (chance 0), which we do not have.
CHATCORE_BASELINES = {"laplace_chat_arc_easy": 0.25, "laplace_chat_arc_challenge": 0.25, "laplace_chat_mmlu": 0.25,
                      "laplace_chat_gsm8k": 0.0, "laplace_chat_humaneval": 0.0}


# ------------------------------------------------------------------------------------- tasks

@functools.lru_cache(maxsize=4)
def _task_manager(include_defaults: bool, data_root: str | None):
    from lm_eval.tasks import TaskManager

    # one per setting and process: indexing lm-eval's ~15k built-in tasks takes seconds
    meta = {"data_root": data_root} if data_root else None  # laplace_chat's local copies (tasks/utils.py)
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults, metadata=meta)


def task_manager(names: list[str], data_root: str | None = None):
    """An lm-eval TaskManager that knows eval/tasks and, unless every name is one of ours, lm-eval's
    built-in tasks. An unknown name is a one-line error listing close ones."""
    tm = _task_manager(False, data_root)
    if not all(n in tm.task_index for n in names):
        tm = _task_manager(True, data_root)
    for n in names:
        if n not in tm.task_index:
            # close spellings, else names that contain it (e.g. "arc")
            close = difflib.get_close_matches(n, tm.all_tasks, n=5, cutoff=0.6) or \
                [t for t in tm.all_tasks if n.lower() in t.lower()][:5]
            hint = f"close: {', '.join(close)}" if close else "see `lm_eval ls tasks` and eval/tasks"
            raise ConfigError(f"tasks: unknown task {n!r} ({hint})")
    return tm


def _ours(tm, name: str) -> bool:
    return str(tm.task_index[name].yaml_path or "").startswith(str(TASKS_DIR))


def unsafe_tasks(tm, names) -> list[str]:
    """The tasks among `names` (groups and tags expanded) that run generated code (`unsafe_code:
    true`), read from lm-eval's index: building a task would load its dataset first."""
    from lm_eval.tasks._index import Kind

    found = set()

    def visit(item, unsafe: bool = False):  # unsafe: a group above said so
        entry = tm.task_index.get(item) if isinstance(item, str) else None
        if isinstance(item, list):  # a group's members
            for child in item:
                visit(child, unsafe)
        elif isinstance(item, dict):  # a member written inline, with overrides: a task, or a group (its list)
            visit(item.get("task") or item.get("group"), unsafe or bool(item.get("unsafe_code")))
        elif entry is not None and entry.kind == Kind.TAG:
            visit(sorted(entry.tags), unsafe)
        else:  # the index holds every task's and group's YAML, includes resolved
            cfg = (entry.cfg if entry is not None else None) or {}
            unsafe = unsafe or bool(cfg.get("unsafe_code"))
            if entry is not None and entry.kind == Kind.GROUP:
                visit(cfg.get("task") or [], unsafe)
            elif unsafe and item:
                found.add(str(item))

    visit(list(names))
    return sorted(found)


def check_code_eval_metric(tasks: list[str]) -> None:
    """lm-eval's own humaneval scores with `evaluate`'s code_eval metric, a script fetched from
    the hub on first use: offline without it cached, say so in one line before any model work."""
    if not tasks:  # our own humaneval runs its programs itself (tasks/laplace_chat/utils.py)
        return
    try:
        import evaluate

        evaluate.load("code_eval")  # loading needs no flag; running the code does (HF_ALLOW_CODE_EVAL)
    except Exception as e:  # noqa: BLE001 -- FileNotFoundError / ConnectionError offline, ImportError without evaluate
        raise ConfigError(f"tasks {', '.join(tasks)} score with the `evaluate` library's code_eval metric, "
                          f"which cannot be loaded here ({one_line(e)[:160]}); load it once online "
                          f"(python -c \"import evaluate; evaluate.load('code_eval')\") or use "
                          f"laplace_chat_humaneval, which needs nothing more") from None


# ------------------------------------------------------------------------------------- outputs

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
    # beside the run (an exported folder: in it); a checkpoint other than last.pt adds its stem
    homes = [(run_dir_of(p), "" if p.is_dir() or p.stem == "last" else f"_{p.stem}") for p in paths]
    if cfg.out is None:  # many tasks make a long tag: bounded like a run directory's name
        dirs = [home / "eval" / short_name(tag + stem, MAX_NAME) for home, stem in homes]
    elif len(paths) == 1:
        dirs = [Path(os.path.expanduser(str(cfg.out)))]
    else:
        dirs = [Path(os.path.expanduser(str(cfg.out))) / (home.name + stem) for home, stem in homes]
    for i, d in enumerate(dirs):
        if d in dirs[:i]:
            raise ConfigError(f"checkpoint: {paths[dirs.index(d)]} and {paths[i]} would both write "
                              f"{d}/results.json; evaluate them in separate calls with out=DIR")
    return dirs


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def summarize(res: dict) -> tuple[dict, dict]:
    """lm-eval's results -> (per task {version, n, num_fewshot, metrics: {metric: {value, stderr}}},
    flat {"task/metric": value})."""
    tasks, flat = {}, {}
    n_samples, children = res.get("n-samples", {}), res.get("group_subtasks", {})

    def n_of(name):  # the documents scored; a group's are its tasks'
        if name in n_samples:
            return int(n_samples[name].get("effective", n_samples[name].get("original", 0)))
        if children.get(name):
            return sum(n_of(c) for c in children[name])
        return res["results"].get(name, {}).get("sample_len")

    for name, block in res.get("results", {}).items():
        metrics = {}
        for key, value in block.items():  # lm-eval's keys are "<metric>,<filter>"
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or _number(value) is None:
                continue
            # a filter other than "none" stays in the name; the first filter's value is also the
            # plain name (gsm8k/exact_match = strict-match)
            label = metric if filt == "none" else key
            metrics[label] = {"value": float(value), "stderr": _number(block.get(f"{metric}_stderr,{filt}"))}
            flat[f"{name}/{label}"] = float(value)
            flat.setdefault(f"{name}/{metric}", float(value))
        tasks[name] = {"version": res.get("versions", {}).get(name), "n": n_of(name),
                       "num_fewshot": res.get("n-shot", {}).get(name), "metrics": metrics}
    return tasks, flat


def chatcore(flat: dict) -> dict:
    """{"laplace_chat/chatcore": ChatCORE} when all five laplace_chat tasks were scored, else {}."""
    if not all(f"{t}/acc" in flat for t in CHATCORE_BASELINES):
        return {}
    centred = [(flat[f"{t}/acc"] - b) / (1 - b) for t, b in CHATCORE_BASELINES.items()]
    return {"laplace_chat/chatcore": sum(centred) / len(centred)}


def _quiet(record: logging.LogRecord) -> bool:
    # lm-eval warns, once per task with a custom_dataset (ours), about passing --metadata
    return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


# ------------------------------------------------------------------------------------- command

def evaluate_lm(cfg: DictConfig) -> list[dict]:
    """Run the command: every checkpoint on every task; returns the records written."""
    usage = "python -m eval.lm checkpoint=PATH tasks=[laplace_chat]"
    values, names = required_list(cfg, "checkpoint", usage), required_list(cfg, "tasks", usage)  # one, or a list
    if not values or not names:
        raise ConfigError(f"checkpoint={values}, tasks={names}: give at least one of each, e.g. {usage}")
    sources = [gpt_source(v) for v in values]  # every checkpoint checked before any evaluation
    tm = task_manager(names, cfg.data_root)
    code_tasks = unsafe_tasks(tm, names)
    if code_tasks and not cfg.allow_code_execution:
        raise ConfigError(f"tasks {', '.join(code_tasks)} run model-generated code on this machine: pass "
                          f"allow_code_execution=true, or leave them out of tasks=[...]")
    check_code_eval_metric([t for t in code_tasks if not _ours(tm, t)])
    ours = [n for n in names if _ours(tm, n)]
    if cfg.apply_chat_template and ours:
        raise ConfigError(f"apply_chat_template=true with {', '.join(ours)}: those tasks render our chat "
                          f"format themselves; use apply_chat_template=false")
    dirs = out_dirs(cfg, [s["path"] for s in sources], names)
    for d in dirs:  # and every output folder: results are written after hours of evaluation
        check_writable(d, "out")

    import lm_eval
    from lm_eval.utils import make_table

    import eval.lm_adapter  # noqa: F401  registers the "laplace" model

    logging.getLogger("lm_eval.api.task").addFilter(_quiet)  # a function is added once
    gen_kwargs = {"max_gen_toks": int(cfg.max_gen_toks)} if cfg.max_gen_toks is not None else None
    seeds = {} if cfg.seed is None else dict.fromkeys(
        ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), int(cfg.seed))
    records = []
    for src, d in zip(sources, dirs):
        t0 = time.time()
        try:
            # the flags that let HumanEval run code, set ("1") or cleared ("") for this run only:
            # patch.dict restores the environment as it was when the block ends, whatever happens
            with mock.patch.dict(os.environ, dict.fromkeys(CODE_ENV, "1" if cfg.allow_code_execution else "")):
                res = lm_eval.simple_evaluate(
                    model="laplace", model_args={"checkpoint": str(src["path"]), "dtype": str(cfg.dtype)},
                    tasks=list(names), num_fewshot=cfg.num_fewshot, batch_size=int(cfg.batch_size),
                    device=str(cfg.device), limit=cfg.limit, bootstrap_iters=int(cfg.bootstrap_iters),
                    apply_chat_template=bool(cfg.apply_chat_template), gen_kwargs=gen_kwargs,
                    task_manager=tm, confirm_run_unsafe_code=bool(cfg.allow_code_execution),
                    **seeds)
        except ConnectionError as e:  # lm-eval's own tasks read the hub through `datasets`: unreachable
            raise ConfigError(f"{one_line(e)[:200]}: lm-eval's tasks read their hub datasets through `datasets`; "
                              f"offline, fill the HF cache first (HF_DATASETS_OFFLINE=1 then reads it), or use "
                              f"the laplace_chat tasks with data_root=DIR") from None
        tasks, flat = summarize(res)
        flat |= chatcore(flat)
        record = {**results_header(src["node"], src["dataset"], src["path"], step=src["step"]),
                  "evaluation": "lm_eval", "lm_eval_version": res.get("lm_eval_version"),
                  "tasks_requested": list(names), "num_fewshot": cfg.num_fewshot, "limit": cfg.limit,
                  "apply_chat_template": bool(cfg.apply_chat_template),
                  "data_root": None if cfg.data_root is None else str(cfg.data_root),
                  "seconds": round(time.time() - t0, 1), "tasks": tasks, **flat}
        write_json(d / "results.json", record)
        # lm-eval's table (its groups with their aggregate are rows of it too)
        print(f"[lm_eval] {src['path']} (step {src['step']})\n{make_table(res)}")
        if "laplace_chat/chatcore" in flat:
            print(f"[lm_eval] ChatCORE {flat['laplace_chat/chatcore']:.4f}")
        print(f"[lm_eval] wrote {d / 'results.json'}", flush=True)
        if src["path"].is_file():  # "lm/<task>/<metric>" in the W&B run of the GPT's training, if any
            log_to_training_run(src["path"], flat, "lm")
        records.append(record)
    return records


main = hydra_entry("lm_eval")(evaluate_lm)


if __name__ == "__main__":
    main()
