"""The record of a `python -m bench` run: machine, versions, ratios with verdicts, Markdown."""
from __future__ import annotations

import math
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Optional

import torch

# The project's targets: Laplacian heads cost at most 1% over k = 0 in time and memory, and
# our implementation is no slower / larger than timm's.
TARGET_VS_K0 = 1.01
TARGET_VS_TIMM = 1.00


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(root: Path) -> Optional[str]:
    """HEAD's commit, read from the .git folder (no git process); None outside a checkout."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree / submodule: "gitdir: <path>"
            git = (root / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        common = git / "commondir"
        bases = [git] + ([(git / common.read_text().strip()).resolve()] if common.is_file() else [])
        for base in bases:
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except OSError:
        pass
    return None


def machine_info(device_type: str) -> dict:
    import numpy
    import timm

    info = dict(kind=device_type, host=platform.node(), platform=platform.platform(),
                cpu=cpu_model(), cpu_count=os.cpu_count(),
                cpus_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                torch_threads=torch.get_num_threads(),
                python=platform.python_version(), torch=torch.__version__, timm=timm.__version__,
                numpy=numpy.__version__)
    if device_type == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(gpu=torch.cuda.get_device_name(), gpu_count=torch.cuda.device_count(),
                    gpu_memory_gib=p.total_memory / 2**30, gpu_capability=f"{p.major}.{p.minor}",
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return info


def slug(text: str, words: int = 3) -> str:
    text = re.sub(r"\(.*?\)|\b(nvidia|geforce|processor|cpu|core|tm|r)\b", " ", text.lower())
    parts = [p for p in re.split(r"[^a-z0-9]+", text) if p][:words]
    return "-".join(parts) or "unknown"


def record_stem(record: dict) -> str:
    """<date>_<device kind>_<GPU name, or CPU model and usable cores>[_smoke]."""
    m = record["machine"]
    name = slug(m["gpu"]) if m["kind"] == "cuda" else f"{slug(m['cpu'])}-{m['cpus_usable']}c"
    return f"{record['date'][:10]}_{m['kind']}_{name}" + ("_smoke" if record["args"].get("smoke") else "")


def _ratio(a, b) -> Optional[float]:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b


def ratios(cases: list[dict], device_type: str) -> list[dict]:
    """Every k > 0 against k = 0 (target 1.01), ours at k = 0 and k = all against timm (1.00),
    within one section, family and mode. Time: median / median (the verdict), min / min and on
    CPU the process-CPU-time ratio. Memory: the CUDA peak; on CPU autograd's saved bytes (the
    RSS growth is too rough for 1%), and no memory verdict for compiled models on CPU."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for c in cases:
        groups.setdefault((c["section"], c["family"], c["mode"]), []).append(c)
    for (section, family, mode), cs in groups.items():
        ours = sorted((c for c in cs if c["impl"] == "laplace"), key=lambda c: c["k"])
        timm_ = [c for c in cs if c["impl"] == "timm"]
        pairs = [(c, ours[0], TARGET_VS_K0, "vs k=0") for c in ours[1:]]
        if timm_:
            ends = {id(x): x for x in (ours[0], ours[-1])}.values()  # k = 0 and all (one if equal)
            pairs += [(c, timm_[0], TARGET_VS_TIMM, "vs timm") for c in ends]
        for num, den, target, kind in pairs:
            # CPU compiled: only the RSS growth, too rough for a verdict (memory_met stays None)
            basis = "peak" if device_type == "cuda" else "saved" if mode == "eager" else "rss"
            key = "saved_mb" if basis == "saved" else "peak_mb"
            r = dict(section=section, family=family, mode=mode, kind=kind, num=num["name"], den=den["name"],
                     time=_ratio(num["median_ms"], den["median_ms"]), time_min=_ratio(num["min_ms"], den["min_ms"]),
                     cpu_time=_ratio(num.get("cpu_ms"), den.get("cpu_ms")),
                     memory=_ratio(num[key], den[key]), memory_basis=basis,
                     peak=_ratio(num["peak_mb"], den["peak_mb"]), saved=_ratio(num["saved_mb"], den["saved_mb"]),
                     target=target)
            r["time_met"] = r["time"] is not None and r["time"] <= target
            r["memory_met"] = None if basis == "rss" else r["memory"] is not None and r["memory"] <= target
            out.append(r)
    return out


# ----------------------------------------------------------------------------- Markdown
def _f(x, fmt="{:.1f}", none="n/a") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return fmt.format(x)


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _shape(s: dict) -> str:
    if "img_size" in s:
        txt = f"B={s['batch']} {s['img_size']}px"
    else:
        txt = f"B={s['batch']} T={s['tokens']}"
    if s.get("overrides"):
        txt += " " + ",".join(f"{k}={v}" for k, v in s["overrides"].items())
    return txt


def _verdict(met: Optional[bool], value) -> str:
    return "n/a" if value is None or met is None else ("met" if met else "**NOT met**")


def markdown(record: dict) -> str:
    m, a, cpu = record["machine"], record["settings"], record["machine"]["kind"] == "cpu"
    dev = m.get("gpu") or f"{m['cpu']}, {m['cpus_usable']} usable of {m['cpu_count']} cores"
    lines = [f"# bench {record['date']}", "",
             f"- machine: {m['kind']}: {dev}; host {m['host']}; {m['torch_threads']} torch threads",
             f"- versions: python {m['python']}, torch {m['torch']}, timm {m['timm']}"
             + (f", CUDA {m['cuda']}" if m.get("cuda") else ""),
             f"- commit: {record['git_commit'] or 'unknown'}",
             f"- command: `{record['command']}`",
             f"- settings: dtype {a['dtype']}, modes {', '.join(a['modes'])}, steps {a['steps']} "
             f"(warm-up {a['warmup']}), layer steps {a['layer_steps']} (warm-up {a['layer_warmup']})"]
    if record.get("note"):
        lines.append(f"- note: {record['note']}")
    peak = "RSS+ MB" if cpu else "peak MB"
    titles = {"layer": "Attention layer alone (forward + backward)",
              "step": "Training step (forward, backward, optimizer step)"}
    for section, title in titles.items():
        cs = [c for c in record["cases"] if c["section"] == section]
        if not cs:
            continue
        head = ["model", "k", "mode", "shape", "median ms", "min ms", "spread"] + (["cpu ms"] if cpu else []) \
            + [peak, "saved MB"] + (["optimizer"] if section == "step" else [])
        rows = []
        for c in cs:
            row = [c["name"], "timm" if c["k"] is None else f"{c['k']}/{c['heads']}", c["mode"], _shape(c["shape"]),
                   _f(c["median_ms"], "{:.2f}"), _f(c["min_ms"], "{:.2f}"), _f(100 * c["spread"], "{:.0f}%")]
            row += [_f(c.get("cpu_ms"), "{:.2f}")] if cpu else []
            row += [_f(c["peak_mb"], "{:.1f}"), _f(c["saved_mb"], "{:.1f}")]
            row += [c["optimizer"].split(" (")[0]] if section == "step" else []
            rows.append(row)
        lines += ["", f"## {title}", ""] + md_table(head, rows)
    if record["ratios"]:
        head = ["section", "mode", "ratio", "time", "min/min"] + (["cpu time"] if cpu else []) \
            + ["memory", "target", "time", "memory"]
        rows = []
        for r in record["ratios"]:
            row = [r["section"], r["mode"], f"{r['num']} / {r['den']}", _f(r["time"], "{:.3f}"),
                   _f(r["time_min"], "{:.3f}")]
            row += [_f(r["cpu_time"], "{:.3f}")] if cpu else []
            row += [f"{_f(r['memory'], '{:.3f}')} ({r['memory_basis']})", f"<= {r['target']:.2f}",
                    _verdict(r["time_met"], r["time"]), _verdict(r["memory_met"], r["memory"])]
            rows.append(row)
        lines += ["", "## Ratios and targets (time: median / median wall time)", ""] + md_table(head, rows)
        if cpu:
            lines += ["", "On CPU the memory ratio is of autograd's saved bytes (exact; compiled models: the RSS "
                          "growth, no verdict); RSS+ is the resident-set growth during the first step (rough). CPU "
                          "timings on a shared machine move by several percent between runs: compare ratios, and "
                          "the cpu-time column."]
    ld = record.get("loader")
    if ld:
        lines += ["", "## LM loader (TokenStream, one epoch of random uint16 shards)", ""] + md_table(
            ["tokens", "shards", "seq_len x batch", "tokens/s", "batches/s", "RssAnon growth MiB", "RssFile after MiB"],
            [[f"{ld['tokens']:,}", str(ld["shards"]), f"{ld['seq_len']} x {ld['micro_batch']}",
              f"{ld['tokens_per_s']:,.0f}", f"{ld['batches_per_s']:,.0f}", f"{ld['anon_growth_mib']:+.1f}",
              f"{ld['mem_after_mib'].get('RssFile', float('nan')):,.0f}"]])
    if record.get("images"):
        lines += images_markdown(record["images"])
    tk = record.get("tokenizer")
    if tk:
        lines += ["", f"## Tokenizer (BPE vocab {tk['vocab']:,} trained on the help text in {tk['train_s']:.2f} s; "
                      f"encode_batch over {tk['chars']:,} characters, {tk['chars_per_token']:.2f} chars/token)", ""]
        lines += md_table(["threads", "tokens", "seconds", "tokens/s", "tokens/s per thread"],
                          [[str(r["threads"]), f"{r['tokens']:,}", f"{r['seconds']:.2f}", f"{r['tokens_per_s']:,.0f}",
                            f"{r['tokens_per_s_per_thread']:,.0f}"] for r in tk["runs"]])
    an = record.get("analysis")
    if an:
        r0 = an[0]
        lines += ["", f"## Analysis accumulator (GeometryAccumulator, D={r0['dim']}, {r0['seqs']} sequences, "
                      f"{r0['classes']} classes, batches of {r0['batch']}, metrics {'/'.join(r0['metrics'])}; "
                      f"a fresh process per N)", ""]
        head = ["tokens", "update tokens/s", "update GFLOP/s", "X^T X matmul tokens/s", "update / matmul",
                "compute() s", "peak RSS MiB", "RSS before MiB"] + (["CUDA peak MiB"] if not cpu else [])
        rows = []
        for r in an:
            row = [f"{r['tokens']:,}", f"{r['update_tokens_per_s']:,.0f}", f"{r['update_gflops']:.1f}",
                   f"{r['matmul_tokens_per_s']:,.0f}", f"{r['update_vs_matmul']:.2f}", f"{r['compute_s']:.2f}",
                   f"{r['peak_rss_mib']:,.0f}", f"{r['rss_before_accumulator_mib']:,.0f}"]
            row += [_f(r["cuda_peak_mib"], "{:,.0f}")] if not cpu else []
            rows.append(row)
        lines += md_table(head, rows)
    if record.get("gpt_memory"):
        lines += gpt_memory_markdown(record["gpt_memory"])
    return "\n".join(lines) + "\n"


def images_markdown(im: dict) -> list[str]:
    """The images section (bench/images.py) as Markdown lines."""
    g = im["gpu_record"]
    shots = ", ".join(f"{p['name']} {p['size'][0]}x{p['size'][1]} ({p['jpeg_kib']:.0f} KiB)" for p in im["photos"])
    lines = ["", f"## Image input paths: one worker process, 1 torch thread ({im['files']} JPEGs of {shots}; "
                 f"img_size {im['img_size']}, eval crop {im['eval_crop_pct']})", "",
             f"Demand: {g['gpu']} {g['model']} {g['img_size']} px {g['mode']} {g['images_per_s']:,.0f} img/s "
             f"({g['source']}), scaled per path, / {im['workers_per_gpu']} workers per GPU.", ""]
    lines += md_table(["path", "layout", "decode", "img/s", "img/s per CPU s", "demand / worker", "supply / demand"],
                      [[r["path"], r["layout"], r["decode"], f"{r['images_per_s']:,.1f}",
                        f"{r['cpu_images_per_s']:,.1f}", f"{r['demand_per_worker']:,.0f}",
                        f"{r['supply_over_demand']:.2f}"] for r in im["rows"]])
    if im.get("pixel_difference"):
        lines += ["", "Reduced against full-size decode, same seeds (0-255 pixel units):", ""]
        lines += md_table(["path", "samples", "mean abs", "max abs", "share > 8"],
                          [[d["path"], str(d["items"]), f"{d['mean_abs']:.3f}", f"{d['max_abs']:.1f}",
                            f"{100 * d['share_over_8']:.2f}%"] for d in im["pixel_difference"]])
    return lines


def gpt_memory_markdown(mem: dict) -> list[str]:
    """The gpt_memory section (bench/gpt_memory.py) as Markdown lines."""
    lines = ["", f"## GPT activation memory ({mem['dtype']}, vocab {mem['vocab_size']:,}, {mem['seq_len']} tokens "
                 f"per sequence; saved bytes per token at 2 sequences minus at 1)", ""]
    peak = any("oom" in r for r in mem["rows"])
    head = ["depth", "width x heads", "model", "k", "grad ckpt", "saved bytes / token"] + \
        ([f"peak GiB, step at {mem['batch']} x {mem['seq_len']}" + (f" (cap {mem['cap_gib']} GiB)" if mem["cap_gib"] else "")]
         if peak else [])
    rows = []
    for r in mem["rows"]:
        row = [str(r["depth"]), f"{r['width']} x {r['heads']}", r["name"], "-" if r["k"] is None else str(r["k"]),
               "on" if r["grad_checkpointing"] else "off", f"{r['saved_bytes_per_token']:,.0f}"]
        if peak:
            row.append("-" if "oom" not in r else "OOM" if r["oom"] else _f(r["peak_gib"], "{:.1f}"))
        rows.append(row)
    lines += md_table(head, rows)
    if mem["ratios"]:
        lines += ["", "Against nanochat (target <= 1.00):", ""]
        lines += md_table(["depth", "ratio", "saved bytes", "verdict"],
                          [[str(r["depth"]), f"{r['num']} / {r['den']}", f"{r['ratio']:.4f}",
                            "-" if r["met"] is None else "met" if r["met"] else "**NOT met**"]
                           for r in mem["ratios"]])
    return lines


def command_line(argv=None) -> str:
    """The command as typed (argv: main's arguments when called in-process)."""
    return ("python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv)).rstrip()
