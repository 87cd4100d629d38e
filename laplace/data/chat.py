"""Chat data for mid-training and SFT: nanochat's tasks, their mixture, and the two datasets the
trainer consumes (packed rows for mid-training, padded conversations for SFT).

Tasks (each a lazily indexed sequence of conversations in `laplace.chat`'s format):

    smoltalk    HuggingFaceTB/smol-smoltalk (train / test): general chat, `messages` as they are
    mmlu        cais/mmlu: `auxiliary_train` (mid-training; its fields sit under a `train`
                column) or a subject / `all` (question, choices, answer index, subject)
    gsm8k       openai/gsm8k, subset main: the `<<expr=result>>` calculator annotations become
                python / python_output parts of the assistant's reply
    arc         allenai/ai2_arc, ARC-Easy / ARC-Challenge: question, choices {text, label}, answerKey
    pydoc_chat  built in, no download: questions about Python's help topics (`pydoc_data.topics`)

MMLU and ARC use nanochat's `render_mc` prompt verbatim (the letter *after* each choice and no
space before it: "- choice=A"), and the assistant answers with the bare letter.

Where the data comes from: `path` is a hub id (then `datasets.load_dataset(hub_id, name=subset,
split=split)`, as nanochat) or a local folder, e.g. one made by

    huggingface-cli download --repo-type dataset cais/mmlu --local-dir /data/mmlu

A local folder is read in the hub repo's layout: `<path>/<subset>/<split>-*.parquet` (mmlu,
gsm8k, ai2_arc), `<path>/data/<split>-*.parquet` (smol-smoltalk), or the subset folder itself
(`<path>/<split>-*.parquet`); `.jsonl` / `.json` files work too. The files are found here and
handed to `datasets.load_dataset("parquet" | "json", data_files={split: files})`, because
`load_dataset(folder, name=subset)` only knows subsets a README's YAML declares (a bare copy of
the files has none), and `data_dir=subset` infers splits from file names, which maps MMLU's
`dev` to validation and reads `auxiliary_train-*` as train.

Mixture (`build_mixture`): nanochat's TaskMixture, a deterministic shuffle of (task, example)
pairs over all tasks, drawn from the config's seed (nanochat: a fixed 42; it also shuffles each
task with seed 42 first, which the mixture's shuffle makes redundant here); nanochat oversamples a task by listing it twice, here a spec's `repeats`
(a float, default 1) says how many times each of its examples appears: 2 = every example twice,
0.5 = a fixed random half. `max_examples` first caps a task at a fixed random subset (nanochat's
`stop=`, but random rather than the first rows, which in MMLU are sorted by subject).

Datasets the trainer consumes (map-style, deterministic, picklable for DataLoader workers):
    SFTDataset + sft_collate   one conversation per row, padded to the batch's longest, targets
                               -1 (ignored) where the mask is 0: nanochat's chat_sft collate
    PackedChatDataset          mid-training: every rendered conversation concatenated and cut
                               into rows of seq_len + 1 tokens. nanochat's mid-training trains on
                               every token; here targets whose mask is 0 (user turns, tool
                               output) are -1 by default (`masked=False`: nanochat's choice).
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from laplace.chat import render_conversation, render_conversations, special_ids
from laplace.errors import ConfigError

from . import DatasetNotFoundError

HUB_IDS = {"smoltalk": "HuggingFaceTB/smol-smoltalk", "mmlu": "cais/mmlu", "gsm8k": "openai/gsm8k",
           "arc": "allenai/ai2_arc"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FORMATS = (("parquet", "parquet"), ("jsonl", "json"), ("json", "json"))  # file suffix, builder


# --------------------------------------------------------------------------------------------
# Reading a split through HF datasets
# --------------------------------------------------------------------------------------------

def _split_files(folder: Path, split: str) -> tuple[str | None, list[str]]:
    """(builder, files) of `split` directly in `folder`: `<split>-*.<ext>` or `<split>.<ext>`."""
    for ext, builder in _FORMATS:
        files = sorted({*folder.glob(f"{split}-*.{ext}"), *folder.glob(f"{split}.{ext}")})
        if files:
            return builder, [str(f) for f in files]
    return None, []


def load_split(path: str, subset: str | None, split: str, *, key: str = "path",
               cache_dir: str | None = None):
    """A `datasets.Dataset`: one split of a hub dataset or of a local copy of its files.

    Args:
        path: a local folder (the hub repo's layout, or the subset folder itself) or a hub id.
        subset: the hub's config name (cais/mmlu: auxiliary_train, all, a subject; None: the
            dataset has one).
        split: train, test, validation, dev, ...
        key: the config key that gave `path`, named in errors.
        cache_dir: where `datasets` keeps its Arrow cache (None: HF_DATASETS_CACHE).
    """
    import datasets

    local = Path(os.path.expanduser(str(path)))
    if local.exists():
        if not local.is_dir():
            raise DatasetNotFoundError(f"{key}={path} is a file; give the dataset's folder (its "
                                       f"hub layout: <folder>/<subset>/<split>-*.parquet)")
        candidates = ([local / subset] if subset else [local / "data"]) + [local]
        for folder in candidates:
            builder, files = _split_files(folder, split)
            if files:
                return datasets.load_dataset(builder, data_files={split: files}, split=split,
                                             cache_dir=cache_dir)
        looked = " or ".join(f"{c}/{split}-*.parquet" for c in candidates)
        raise DatasetNotFoundError(f"{key}={path}: no {split!r} split files ({looked}); download the "
                                   f"dataset with `huggingface-cli download --repo-type dataset <hub "
                                   f"id> --local-dir {path}`")
    if not _HUB_ID.match(str(path)):
        raise DatasetNotFoundError(f"{key}={path}: no such folder; download the dataset with "
                                   f"`huggingface-cli download --repo-type dataset <hub id> "
                                   f"--local-dir {path}`, or give its hub id")
    try:
        return datasets.load_dataset(str(path), name=subset, split=split, cache_dir=cache_dir)
    except (ConnectionError, OSError, datasets.exceptions.DatasetNotFoundError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DatasetNotFoundError(f"{key}={path}: cannot load the hub dataset (subset {subset}, split "
                                   f"{split}): {first}; offline, download it with `huggingface-cli "
                                   f"download --repo-type dataset {path} --local-dir DIR` and set "
                                   f"{key}=DIR") from None


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------

def render_mc(question: str, letters: Sequence[str], choices: Sequence[str]) -> str:
    """nanochat's multiple-choice prompt, verbatim: the letter after each choice binds better in
    small models, and "=A" (no space) gives the same token as the bare-letter answer."""
    query = f"Multiple Choice question: {question}\n"
    query += "".join(f"- {choice}={letter}\n" for letter, choice in zip(letters, choices))
    return query + "\nRespond only with the letter of the correct answer."


class ChatTask(Dataset):
    """Conversations over the rows of a `datasets.Dataset` (or any indexable of rows), built on
    access so that a 460k-row task costs no memory up front."""

    name = "task"

    def __init__(self, rows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.name}: index {i} out of range ({len(self)} conversations)")
        return self.conversation(self.rows[int(i)])

    def conversation(self, row: Mapping) -> dict:
        raise NotImplementedError


class SmolTalk(ChatTask):
    """HuggingFaceTB/smol-smoltalk: `messages` [{role, content}] with an optional system
    message, passed through as they are (`render_conversation` checks the roles)."""

    name = "smoltalk"

    def conversation(self, row):
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]]}


class MMLU(ChatTask):
    """cais/mmlu as lettered multiple choice. In `auxiliary_train` each row's fields are under
    a `train` column; nanochat unwraps it with a `.map`, here it is unwrapped on access (no
    rewritten Arrow copy of the 100k rows)."""

    name = "mmlu"
    letters = ("A", "B", "C", "D")

    def conversation(self, row):
        if "train" in row and isinstance(row["train"], Mapping):
            row = row["train"]
        letters = self.letters[:len(row["choices"])]
        return {"messages": [{"role": "user", "content": render_mc(row["question"], letters, row["choices"])},
                             {"role": "assistant", "content": letters[int(row["answer"])]}],
                "subject": row.get("subject", ""), "letters": letters}


class ARC(ChatTask):
    """allenai/ai2_arc as lettered multiple choice with the dataset's own labels (a few rows
    use 1-4 instead of A-D), as nanochat."""

    name = "arc"

    def conversation(self, row):
        letters = tuple(row["choices"]["label"])
        return {"messages": [{"role": "user", "content": render_mc(row["question"], letters,
                                                                    row["choices"]["text"])},
                             {"role": "assistant", "content": row["answerKey"]}],
                "letters": letters}


_CALC = re.compile(r"(<<[^>]+>>)")


def gsm8k_parts(answer: str) -> list[dict]:
    """GSM8K's worked answer as assistant parts, as nanochat: each `<<expr=result>>` becomes a
    python part `expr` (the model's calculator call) and a python_output part `result` (the
    tool's answer); the text between them stays text, the final `#### N` included."""
    parts = []
    for piece in _CALC.split(answer):
        if piece.startswith("<<") and piece.endswith(">>"):
            expr, eq, result = piece[2:-2].rpartition("=")
            if not eq:  # no "=": a call without a recorded result
                expr, result = piece[2:-2], ""
            parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


class GSM8K(ChatTask):
    """openai/gsm8k (subset main): question -> worked answer with calculator tool calls."""

    name = "gsm8k"

    def conversation(self, row):
        return {"messages": [{"role": "user", "content": row["question"]},
                             {"role": "assistant", "content": gsm8k_parts(row["answer"])}]}


_QUESTIONS = ("What does the Python documentation say about {t}?",
              "Explain {t} in Python.",
              "I'm reading Python's reference manual. Can you summarise the section \"{t}\"?")


def _topic_title(text: str) -> str:
    return text.split("\n", 1)[0].strip()


def _subject(title: str) -> str:
    """A title as the object of a question: 'The "for" statement' -> 'the "for" statement'."""
    return "t" + title[1:] if title.startswith("The ") else title


def _blocks(text: str) -> list[tuple[bool, str]]:
    """A help topic after its title as (is_prose, text) blocks: prose paragraphs unwrapped onto
    one line, code and grammar blocks (indented in the source) kept verbatim, rules dropped."""
    body = text.split("\n", 1)[1] if "\n" in text else ""
    out = []
    for block in re.split(r"\n\s*\n", body):
        if not block.strip() or set(block.strip()) <= set("*=-"):
            continue
        lines = block.split("\n")
        if lines[0].startswith((" ", "\t")):
            out.append((False, block.rstrip()))
        else:
            out.append((True, " ".join(line.strip() for line in lines)))
    return out


def _capped(blocks: list[tuple[bool, str]], max_chars: int) -> str:
    """Whole blocks from the first prose paragraph on, up to max_chars; a first paragraph
    longer than that ends at its last full sentence within the cap."""
    while blocks and not blocks[0][0]:
        blocks = blocks[1:]
    out = ""
    for _, b in blocks:
        if out and len(out) + 2 + len(b) > max_chars:
            break
        out = f"{out}\n\n{b}" if out else b
    if len(out) > max_chars:
        cut = out[:max_chars]
        end = cut.rfind(". ")
        out = cut[:end + 1] if end > 0 else cut.rstrip() + "..."
    return out.rstrip(":") + ("." if out.endswith(":") else "")


class PydocChat(ChatTask):
    """A built-in chat set from Python's help topics (no download, deterministic).

    For every topic of the split (every 10th topic sorted by name is held out, as
    `data=pydoc_text`): one question per template in `_QUESTIONS` about the topic's title,
    answered with its first paragraphs and code blocks (at most `max_chars`), and one
    multiple-choice question per stand-alone prose paragraph ("which section is this passage
    from?", four titles in nanochat's `render_mc` format, distractors drawn with a seed derived
    from the topic and paragraph). About 1,100 conversations in train and 60 in val (the
    topics vary with the Python version).

    Args:
        split: train | val.
        max_chars: longest answer in characters.
    """

    name = "pydoc_chat"

    def __init__(self, split: str = "train", max_chars: int = 600):
        from pydoc_data.topics import topics

        from .text import pydoc_documents

        if split not in ("train", "val"):
            raise ConfigError(f"pydoc_chat split={split!r}: choose train or val")
        docs = pydoc_documents(train=split == "train")
        all_titles = sorted({_topic_title(t) for t in topics.values()})
        rows = []
        for d, text in enumerate(docs):
            title, blocks = _topic_title(text), _blocks(text)
            if not any(prose for prose, _ in blocks):
                continue
            answer = _capped(blocks, max_chars)
            rows += [{"kind": "qa", "title": title, "question": q.format(t=_subject(title)), "answer": answer}
                     for q in _QUESTIONS]
            # Passages for the multiple choice: prose that stands alone (not "... as follows:").
            passages = [b for prose, b in blocks if prose and len(b) >= 40 and not b.endswith(":")]
            others = [t for t in all_titles if t != title]
            for j, para in enumerate(passages):
                rng = np.random.default_rng([d, j, len(docs)])
                choices = [title] + [others[k] for k in rng.choice(len(others), 3, replace=False)]
                order = rng.permutation(4)
                rows.append({"kind": "mc", "passage": _capped([(True, para)], max_chars),
                             "choices": [choices[k] for k in order],
                             "answer": int(np.flatnonzero(order == 0)[0])})
        super().__init__(rows)

    def conversation(self, row):
        if row["kind"] == "qa":
            return {"messages": [{"role": "user", "content": row["question"]},
                                 {"role": "assistant", "content": row["answer"]}]}
        letters = MMLU.letters
        question = f"Which section of the Python documentation is this passage from?\n\n{row['passage']}\n"
        return {"messages": [{"role": "user", "content": render_mc(question, letters, row["choices"])},
                             {"role": "assistant", "content": letters[row["answer"]]}],
                "letters": letters}


TASKS = {"smoltalk": SmolTalk, "mmlu": MMLU, "gsm8k": GSM8K, "arc": ARC, "pydoc_chat": PydocChat}
DEFAULT_SUBSETS = {"smoltalk": None, "mmlu": "auxiliary_train", "gsm8k": "main", "arc": "ARC-Easy"}


def load_task(task: str, path: str | None = None, subset: str | None = None, split: str = "train",
              *, key: str = "task", cache_dir: str | None = None) -> ChatTask:
    """One task by name. `path`: hub id or local folder (None: the task's hub id); `subset`
    None: the task's usual one (mmlu: auxiliary_train, gsm8k: main, arc: ARC-Easy); `key`: the
    config node named in errors."""
    if task not in TASKS:
        raise ConfigError(f"{key}.task={task!r}: choose one of {', '.join(TASKS)}")
    if task == "pydoc_chat":
        if path is not None:
            raise ConfigError(f"{key}.path={path}: pydoc_chat is built in and reads no files; remove the key")
        return PydocChat(split)
    rows = load_split(path or HUB_IDS[task], subset or DEFAULT_SUBSETS[task], split,
                      key=f"{key}.path", cache_dir=cache_dir)
    return TASKS[task](rows)


# --------------------------------------------------------------------------------------------
# Mixture
# --------------------------------------------------------------------------------------------

_SPEC_KEYS = ("task", "path", "subset", "split", "repeats", "max_examples")


class ChatMixture(Dataset):
    """Conversations of several tasks in one deterministic shuffled order (nanochat's
    TaskMixture). Item i is `tasks[task_of[i]][index_of[i]]`; the two index arrays are the only
    memory it holds (12 bytes per conversation)."""

    def __init__(self, tasks: Sequence[ChatTask], task_of: np.ndarray, index_of: np.ndarray,
                 names: Sequence[str]):
        self.tasks, self.task_of, self.index_of, self.names = list(tasks), task_of, index_of, list(names)

    def __len__(self) -> int:
        return len(self.task_of)

    def __getitem__(self, i: int) -> dict:
        return self.tasks[int(self.task_of[i])][int(self.index_of[i])]

    def counts(self) -> dict[str, int]:
        """Conversations per task (a repeated task counts every repeat)."""
        n = np.bincount(self.task_of, minlength=len(self.tasks))
        return {name: int(c) for name, c in zip(self.names, n)}


def _plain(spec) -> dict:
    try:  # a DictConfig node: resolved to plain data
        from omegaconf import DictConfig, OmegaConf

        if isinstance(spec, DictConfig):
            return OmegaConf.to_container(spec, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf ships with hydra
        pass
    return dict(spec)


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
    rng = np.random.default_rng(seed)
    tasks, names, task_of, index_of = [], [], [], []
    for t, raw in enumerate(specs):
        where = f"{key}[{t}]"
        spec = _plain(raw)
        unknown = sorted(set(spec) - set(_SPEC_KEYS))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key; a task spec takes {', '.join(_SPEC_KEYS)}")
        if "task" not in spec:
            raise ConfigError(f"{where}.task is missing: choose one of {', '.join(TASKS)}")
        repeats = float(spec.get("repeats") if spec.get("repeats") is not None else 1.0)
        if not (math.isfinite(repeats) and repeats >= 0):
            raise ConfigError(f"{where}.repeats={spec.get('repeats')}: use a number >= 0 (2 = every example twice)")
        cap = spec.get("max_examples")
        if cap is not None and int(cap) < 1:
            raise ConfigError(f"{where}.max_examples={cap}: use a positive count or null (all)")
        task = load_task(spec["task"], spec.get("path"), spec.get("subset"), spec.get("split") or "train",
                         key=where, cache_dir=cache_dir)
        n = len(task)
        local = rng.permutation(n)[:int(cap)] if cap is not None else np.arange(n)
        whole, frac = divmod(repeats, 1.0)
        picked = [local] * int(whole)
        if frac > 0:
            picked.append(rng.permutation(local)[:round(frac * len(local))])
        idx = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
        tasks.append(task)
        names.append(spec["task"] if spec["task"] not in names else f"{spec['task']}#{t}")
        task_of.append(np.full(len(idx), t, dtype=np.int32))
        index_of.append(idx.astype(np.int64))
    task_of, index_of = np.concatenate(task_of), np.concatenate(index_of)
    order = rng.permutation(len(task_of))
    return ChatMixture(tasks, task_of[order], index_of[order], names)


# --------------------------------------------------------------------------------------------
# What the trainer consumes
# --------------------------------------------------------------------------------------------

class SFTDataset(Dataset):
    """One rendered conversation per item: (ids LongTensor[L], mask LongTensor[L]), L <=
    max_tokens. Rendering happens on access (in the DataLoader's workers); batch with
    `sft_collate`.

    Args:
        conversations: any indexable of conversations (a task, a ChatMixture, a list).
        tok: the tokenizer (with the chat special tokens).
        max_tokens: truncate longer conversations (nanochat: 2048).
    """

    def __init__(self, conversations, tok, max_tokens: int = 2048):
        special_ids(tok)  # fail here, not in a worker, when the tokenizer has no chat tokens
        self.conversations, self.tok, self.max_tokens = conversations, tok, max_tokens

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = render_conversation(self.tok, self.conversations[i], self.max_tokens)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def sft_collate(items: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch SFT items as nanochat's chat_sft: x [B, T] the ids without their last token,
    y [B, T] the ids without their first, set to -1 (ignore_index) where the target's mask is 0
    and on padding; T = the longest item's length - 1. nanochat pads x with <|assistant_end|>:
    any id works since padded targets are ignored and attention is causal."""
    T = max(len(ids) for ids, _ in items) - 1
    if T < 1:
        raise ValueError("sft_collate: every conversation has fewer than 2 tokens")
    x = torch.full((len(items), T), pad_id, dtype=torch.long)
    y = torch.full((len(items), T), -1, dtype=torch.long)
    for b, (ids, mask) in enumerate(items):
        n = len(ids) - 1
        if n < 1:
            continue
        x[b, :n] = ids[:-1]
        y[b, :n] = torch.where(mask[1:].bool(), ids[1:], torch.full_like(ids[1:], -1))
    return x, y


class PackedChatDataset(Dataset):
    """Mid-training rows: every conversation rendered (in order, untruncated) and concatenated
    into one token stream cut into windows of seq_len + 1 tokens, consecutive windows sharing
    one token (as `data=pydoc_text`'s TokenWindows), so every token is a target exactly once.
    Item i is (x [seq_len], y [seq_len]): y is x shifted by one, -1 where the target's mask is 0
    (with `masked`; nanochat's mid-training trains on every token: masked=False). The tail
    shorter than a row is dropped. Built once: int32 tokens and a bool mask, 5 bytes per token.

    Args:
        conversations: any indexable of conversations.
        tok: the tokenizer (with the chat special tokens).
        seq_len: the model's context.
        masked: ignore targets whose mask is 0 (user turns, tool outputs, <|bos|>).
        chunk: conversations rendered per `encode_batch` call (bounds the Python lists).
    """

    def __init__(self, conversations, tok, seq_len: int, masked: bool = True, chunk: int = 4096,
                 num_threads: int | None = None):
        self.seq_len, self.masked = int(seq_len), masked
        n = len(conversations)
        tokens, masks = [], []
        for start in range(0, n, chunk):
            batch = [conversations[i] for i in range(start, min(n, start + chunk))]
            for ids, mask in render_conversations(tok, batch, max_tokens=None, num_threads=num_threads):
                tokens.append(np.asarray(ids, dtype=np.int32))
                masks.append(np.asarray(mask, dtype=np.bool_))
        self.tokens = torch.from_numpy(np.concatenate(tokens) if tokens else np.zeros(0, np.int32))
        self.mask = torch.from_numpy(np.concatenate(masks) if masks else np.zeros(0, np.bool_))
        self.n = max(0, (len(self.tokens) - 1) // self.seq_len)
        if self.n == 0:
            raise ConfigError(f"seq_len={seq_len} is longer than all {n} conversations together "
                              f"({len(self.tokens)} tokens): use more conversations or a shorter seq_len")

    def __len__(self) -> int:
        return self.n

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw window i: (tokens LongTensor[seq_len + 1], mask BoolTensor[seq_len + 1])."""
        if not 0 <= i < self.n:
            raise IndexError(f"row {i} out of range ({self.n} rows)")
        s = slice(i * self.seq_len, (i + 1) * self.seq_len + 1)
        return self.tokens[s].long(), self.mask[s]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask = self.row(i)
        x, y = tokens[:-1], tokens[1:].clone()
        if self.masked:
            y[~mask[1:]] = -1
        return x, y
