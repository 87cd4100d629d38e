"""Chat tasks by name and their mixture: nanochat's TaskMixture, a deterministic shuffle of
(task, example) pairs with per-task caps and repeats (docs/text_data.md)."""
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset

from laplace.errors import ConfigError

from .pydoc_chat import PydocChat
from .sources import HUB_IDS, load_split
from .tasks import ARC, GSM8K, MMLU, ChatTask, SmolTalk

TASKS = {"smoltalk": SmolTalk, "mmlu": MMLU, "gsm8k": GSM8K, "arc": ARC, "pydoc_chat": PydocChat}
# The subsets nanochat's mid-training and SFT read (MMLU's auxiliary_train: 100 k training
# questions, never its test split; ARC-Easy for SFT; GSM8K's main, with calculator annotations)
DEFAULT_SUBSETS = {"smoltalk": None, "mmlu": "auxiliary_train", "gsm8k": "main", "arc": "ARC-Easy"}


def load_task(task: str, path: str | None = None, subset: str | None = None, split: str = "train",
              *, key: str = "task", cache_dir: str | None = None) -> ChatTask:
    """One task by name. `path`: hub id or local folder (None: the task's hub id); `subset`
    None: the task's usual one (mmlu: auxiliary_train, gsm8k: main, arc: ARC-Easy); `key`: the
    config node named in errors."""
    if task not in TASKS:
        raise ConfigError(f"{key}.task={task!r}: choose one of {', '.join(TASKS)}")
    if task == "pydoc_chat":  # built in: nothing to load
        if path is not None:
            raise ConfigError(f"{key}.path={path}: pydoc_chat is built in and reads no files; remove the key")
        return PydocChat(split)
    rows = load_split(path or HUB_IDS[task], subset or DEFAULT_SUBSETS[task], split,
                      key=f"{key}.path", cache_dir=cache_dir)
    return TASKS[task](rows)


_SPEC_KEYS = ("task", "path", "subset", "split", "repeats", "max_examples")  # a typo is refused, not ignored


class ChatMixture(Dataset):
    """Conversations of several tasks in one deterministic shuffled order (nanochat's
    TaskMixture). Item i is `tasks[task_of[i]][index_of[i]]`; the two index arrays are the only
    memory it holds (12 bytes per conversation)."""

    def __init__(self, tasks: Sequence[ChatTask], task_of: np.ndarray, index_of: np.ndarray):
        self.tasks, self.task_of, self.index_of = list(tasks), task_of, index_of

    def __len__(self) -> int:
        return len(self.task_of)

    def __getitem__(self, i: int) -> dict:
        return self.tasks[int(self.task_of[i])][int(self.index_of[i])]


def build_mixture(specs: Sequence[Mapping[str, Any]], seed: int = 0, *, key: str = "data.tasks",
                  cache_dir: str | None = None) -> ChatMixture:
    """A ChatMixture from config specs, each {task, path, subset, split, repeats, max_examples}
    (only `task` is required; `path` defaults to the task's hub id, split to train).

    Per task, in order: `max_examples` keeps a fixed random subset; `repeats` (float >= 0)
    then lists every example floor(repeats) times plus a fixed random fraction of them once
    more. Then all (task, example) pairs are shuffled. Everything is drawn from `seed`.
    """
    if not specs:
        raise ConfigError(f"{key} is empty: give at least one task, e.g. [{{task: pydoc_chat}}]")
    # One generator for every draw, in spec order: the mixture is a function of the specs and seed.
    rng = np.random.default_rng(seed)
    tasks, task_of, index_of = [], [], []
    for t, raw in enumerate(specs):
        where = f"{key}[{t}]"
        spec = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else dict(raw)
        unknown = sorted(set(spec) - set(_SPEC_KEYS))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key; a task spec takes {', '.join(_SPEC_KEYS)}")
        if "task" not in spec:
            raise ConfigError(f"{where}.task is missing: choose one of {', '.join(TASKS)}")
        repeats = float(spec.get("repeats") if spec.get("repeats") is not None else 1.0)  # null: once
        if not (math.isfinite(repeats) and repeats >= 0):
            raise ConfigError(f"{where}.repeats={spec.get('repeats')}: use a number >= 0 (2 = every example twice)")
        cap = spec.get("max_examples")
        if cap is not None and int(cap) < 1:
            raise ConfigError(f"{where}.max_examples={cap}: use a positive count or null (all)")
        task = load_task(spec["task"], spec.get("path"), spec.get("subset"), spec.get("split") or "train",
                         key=where, cache_dir=cache_dir)
        n = len(task)
        # A random subset, not the first rows (MMLU's are sorted by subject).
        local = rng.permutation(n)[:int(cap)] if cap is not None else np.arange(n)
        # repeats=2.5: every example twice, and a fixed random half of them a third time.
        whole, frac = divmod(repeats, 1.0)
        picked = [local] * int(whole)
        if frac > 0:
            picked.append(rng.permutation(local)[:round(frac * len(local))])
        idx = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
        tasks.append(task)
        task_of.append(np.full(len(idx), t, dtype=np.int32))
        index_of.append(idx.astype(np.int64))
    # Index arrays, not conversations: 12 bytes per item, each built when the trainer reads it.
    task_of, index_of = np.concatenate(task_of), np.concatenate(index_of)
    order = rng.permutation(len(task_of))
    return ChatMixture(tasks, task_of[order], index_of[order])
