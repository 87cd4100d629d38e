"""The record of a `python -m bench` run: the machine, the versions and each section's table, as
JSON and Markdown (written atomically, laplace.io)."""
import os
import platform
import re
from pathlib import Path

import pandas as pd
import timm
import torch

from laplace.io import atomic_write, write_json

TITLES = {
    "vit": "Forward + backward of a ViT and of its first attention layer (ms: Timer's median), k Laplacian "
           "heads or another arm (attention); saved_mib: what autograd keeps for backward",
    "gpt_memory": "GPT: saved-for-backward bytes per token, bf16 autocast (two sequences minus one); a step's time",
    "loader": "One data-loader worker (one thread): images/s of each training set; demand: "
              "the one GPU record scaled to the row's model, over 8 workers",
}


def machine(device: str) -> dict:
    # The CPU's model name (/proc/cpuinfo, as lscpu prints it), else the platform's word for it.
    cpuinfo = Path("/proc/cpuinfo")
    found = cpuinfo.exists() and re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M)
    # The kernel capability matters as much as the model name: one name covers AVX-512 and AVX2
    # machines, and ATEN_CPU_CAPABILITY=avx2 picks the slower kernels on purpose.
    info = dict(cpu=found.group(1).strip() if found else platform.processor() or platform.machine(),
                cores=len(os.sched_getaffinity(0)), cpu_capability=torch.backends.cpu.get_cpu_capability(),
                platform=platform.platform(), python=platform.python_version(), torch=torch.__version__,
                timm=timm.__version__)
    if torch.device(device).type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def number(x: float) -> str:
    # Byte counts whole and grouped (572,064), ratios and milliseconds to five digits (1.0036).
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.5g}"


def markdown(record: dict, tables: dict[str, pd.DataFrame]) -> str:
    m = record["machine"]
    lines = [f"# bench {record['date']}", "",
             f"- machine: {m.get('gpu') or m['cpu']}, {m['cores']} cores, torch CPU kernels {m['cpu_capability']}",
             f"- versions: python {m['python']}, torch {m['torch']}, timm {m['timm']}",
             f"- clock: {record['args']['clock']} time (vit; the loader: a worker's CPU time)",
             f"- commit: {record['commit']}", f"- command: `{record['command']}`"]
    if record["note"]:
        lines.append(f"- note: {record['note']}")
    for name, df in tables.items():
        # to_string, not to_markdown: its float_format takes a function (number), tabulate's a format.
        table = df.to_string(index=False, na_rep="-", float_format=number)
        lines += ["", f"## {name}: {TITLES[name]}", "", "```", table, "```"]
    return "\n".join(lines) + "\n"


def write(record: dict, tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    """<out>/<date>_<time>_<device>_<CPU or GPU name>[_smoke].{json,md}; returns both paths."""
    name = record["machine"].get("gpu") or record["machine"]["cpu"]
    # "AMD EPYC 7B13 (x)" -> "amd-epyc-7b13": machines of one kind sort together in the folder.
    slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(.*?\)", "", name.lower())).strip("-")[:24]
    when = record["date"][:19].replace("T", "_").replace(":", "")  # 2026-12-02_231500: one record per run
    stem = f"{when}_{record['device']}_{slug}" + ("_smoke" if record["smoke"] else "")
    # JSON: every row with full precision, for scripts; Markdown: the tables as printed.
    record = dict(record, sections={k: df.to_dict("records") for k, df in tables.items()})
    js = write_json(out / f"{stem}.json", record)
    return [js, atomic_write(out / f"{stem}.md", markdown(record, tables).encode())]
