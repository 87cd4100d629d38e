"""README's "What has run on a GPU" table, rewritten by scripts/gpu_check.py after a run on CUDA.

Each row (a trainer or an evaluation) is held by some of gpu_check's checks; a row whose checks
ran gets this run's result, date, GPU, commit and command, every other row keeps its cells. The
table lives between BEGIN and END in README.md; nothing outside them changes.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

BEGIN = "<!-- gpu-table:begin (rewritten by scripts/gpu_check.sh on CUDA) -->"
END = "<!-- gpu-table:end -->"
HEADER = ["Trainer / evaluation", "Last GPU run", "Date (UTC)", "GPU", "Commit", "Command (checks)"]
DEIT3 = ["deit3_in1k", "deit3_in1k_ft224 (init_from a CUDA run)", "deit3_cifar100"]
GPT = "gpt pipeline: BPE, Muon, SFT, chat"
# README row -> the gpu_check checks that exercise it (scripts/gpu_check.py refuses a name it lacks).
ROWS = {
    "`trainer=deit3` training": DEIT3,
    "`trainer=deit3` evaluation": DEIT3,
    "`trainer=gpt` on shards with Muon": [GPT, "gpt_d20: paper-size steps"],
    "`experiment=gpt_*_sft` (chat SFT)": [GPT],
    "`trainer=dino`": ["dino_digits", "dino_in1k: paper-size steps"],
    "`trainer=seg_linear` / `python -m eval.segmentation`": ["seg_linear"],
    "`python -m eval.knn`, `python -m eval.linear`": ["knn + linear"],
    "`python -m eval.lm` / `eval.lm_adapter` (lm-eval)": ["lm-eval: laplace_pydoc"],
    "`python -m eval.generate`": [GPT],
    "`python -m analysis`": ["analysis of CUDA checkpoints"],
}
NEVER = ["never", "", "", "", ""]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def commit(root: Path) -> str:
    """`git rev-parse --short HEAD`, "+dirty" when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def update(text: str, ran: dict[str, bool], date: str, gpu: str, rev: str, command: str) -> str:
    """text with the table rewritten: ran maps each check that ran to whether it passed."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"README: expected one '{BEGIN}' line, then one '{END}' line around the GPU table")
    head, rest = text.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    kept = {c[0]: c[1:] for c in map(_cells, old.splitlines()) if len(c) == len(HEADER)}
    lines = [_row(HEADER), "|" + "---|" * len(HEADER)]
    for label, checks in ROWS.items():
        here = [name for name in checks if name in ran]
        if here:
            result = "pass" if all(ran[n] for n in here) else "FAIL: " + ", ".join(n for n in here if not ran[n])
            cells = [result, date, gpu, f"`{rev}`", f"`{command}` ({', '.join(here)})"]
        else:
            cells = kept.get(label, NEVER)
        lines.append(_row([label, *cells]))
    return head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail
