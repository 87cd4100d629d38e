"""Run a Python command in this process as `python` would, and record what it used: peak CUDA
memory, torch.compile's graph breaks, recompiles and compiled graphs, the peak resident memory.

    python scripts/gpu_probe.py train.py experiment=gpt_d20 ...     # a script and its arguments
    python scripts/gpu_probe.py -m eval.knn checkpoint=...           # a module
    python scripts/gpu_probe.py -c "import torch; ..."               # a command

With $GPU_PROBE_DIR set, the record goes to <dir>/<pid>.json when the command ends (also by
an exception or sys.exit: DataLoader workers, which leave by os._exit, write none), one file per
process, so a torchrun of N ranks leaves N. scripts/gpu_check.py runs every Python command of
its checks through this file and `summary()` folds a check's records into one line.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import runpy
import sys
from pathlib import Path

GiB = 2**30


class _Counter(logging.Handler):
    def __init__(self):
        super().__init__()
        self.n = 0

    def emit(self, record):
        self.n += 1


def record(recompiles: _Counter) -> dict:
    import torch
    from torch._dynamo.utils import counters

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"peak_gib": torch.cuda.max_memory_allocated() / GiB if cuda else None,
            "reserved_gib": torch.cuda.max_memory_reserved() / GiB if cuda else None,
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB,  # Linux: KiB
            "graph_breaks": sum(counters["graph_break"].values()),
            "break_reasons": [r.splitlines()[0][:160] for r in counters["graph_break"]],
            "recompiles": recompiles.n, "graphs": counters["stats"]["unique_graphs"]}


def summary(folder: Path) -> tuple[str, dict]:
    """(one line, the totals) over the records in `folder`: the largest peak of any process,
    the sums of graph breaks, recompiles and graphs."""
    recs = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]
    if not recs:
        return "no probe record", {}
    peaks = [r["peak_gib"] for r in recs if r["peak_gib"] is not None]
    tot = {"processes": len(recs), "peak_gib": max(peaks) if peaks else None,
           "rss_gib": max(r["rss_gib"] for r in recs),
           **{k: sum(r[k] for r in recs) for k in ("graph_breaks", "recompiles", "graphs")},
           "break_reasons": sorted({b for r in recs for b in r["break_reasons"]})}
    mem = f"peak {tot['peak_gib']:.1f} GiB" if peaks else f"peak RSS {tot['rss_gib']:.1f} GiB (no CUDA)"
    line = f"{mem}; {tot['graphs']} graphs, {tot['graph_breaks']} graph breaks, {tot['recompiles']} recompiles"
    return line, tot


def main():
    import torch

    torch._logging.set_logs(recompiles=True, graph_breaks=True)  # also printed: the log says why
    recompiles = _Counter()
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(recompiles)
    args, out = sys.argv[1:], os.environ.get("GPU_PROBE_DIR")
    pid = os.getpid()
    try:
        if args[0] == "-m":
            sys.argv = args[1:]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = args
            sys.path[0] = str(Path(args[0]).resolve().parent)
            runpy.run_path(args[0], run_name="__main__")
    finally:
        if out and os.getpid() == pid:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / f"{pid}.json").write_text(json.dumps(record(recompiles)))


if __name__ == "__main__":
    main()
