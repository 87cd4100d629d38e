"""Timing and memory of one step of several models, stepped round-robin (`python -m bench`)."""
from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from typing import Callable, Optional

import torch


class RSSSampler:
    """Peak resident set size during a `with` block, sampled from /proc/self/statm (Linux)."""

    def __init__(self, interval: float = 1e-3):
        self.interval, self.page = interval, os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self):
        self.start = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        self.increase = self.peak - self.start


class SavedBytes:
    """Bytes autograd saves for backward inside a `with` block, each storage counted once and
    the module's parameters (which linear layers save too) left out: the activation memory."""

    def __init__(self, module: torch.nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def __enter__(self):
        self.storages = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in self.skip:
                self.storages[s.data_ptr()] = s.nbytes()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.bytes = sum(self.storages.values())


class Case:
    """One measured thing: a module with its fixed inputs and a step closure.

    `zero()` drops the gradients (so that the step re-allocates them, as in training) and
    `run()` is the timed work: forward + backward (+ the optimizer step of a training step).
    """

    def __init__(self, *, section: str, family: str, mode: str, name: str, impl: str,
                 k: Optional[int], heads: int, shape: dict, module: torch.nn.Module,
                 zero: Callable[[], None], run: Callable[[], None], optimizer: Optional[str] = None):
        self.section, self.family, self.mode, self.name, self.impl = section, family, mode, name, impl
        self.k, self.heads, self.shape, self.module, self.optimizer = k, heads, shape, module, optimizer
        self.zero, self.run = zero, run
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.peak_mb = float("nan")
        self.saved_mb = float("nan")

    def step(self):
        self.zero()
        self.run()

    def free(self):
        self.module = self.zero = self.run = None

    def record(self, device_type: str) -> dict:
        med = statistics.median(self.times)
        rec = dict(section=self.section, family=self.family, mode=self.mode, name=self.name,
                   impl=self.impl, k=self.k, heads=self.heads, shape=self.shape, optimizer=self.optimizer,
                   median_ms=1e3 * med, min_ms=1e3 * min(self.times), max_ms=1e3 * max(self.times),
                   spread=(max(self.times) - min(self.times)) / med,
                   times_ms=[round(1e3 * t, 4) for t in self.times],
                   peak_mb=self.peak_mb, saved_mb=self.saved_mb)
        if device_type == "cpu":
            rec["cpu_ms"] = 1e3 * statistics.median(self.cpu_times)
        return rec


def sync(device_type: str):
    if device_type == "cuda":
        torch.cuda.synchronize()


def measure_memory(case: Case, device_type: str, saved_bytes: bool):
    """One step under the memory probes (they would perturb timings, so it is not timed).

    CUDA: max_memory_allocated during the step minus what was allocated before it, with the
    gradients already dropped: activations + gradients + workspace + optimizer temporaries
    (weights and optimizer state excluded). CPU: increase of the resident set size during
    the step (rough: the allocator keeps freed memory and spikes between samples are missed).
    saved: bytes autograd saves for backward, parameters excluded (exact; eager only).
    """
    gc.collect()
    case.zero()
    if device_type == "cuda":
        sync(device_type)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    saved = SavedBytes(case.module) if saved_bytes else None
    with RSSSampler() as rss:
        if saved is not None:
            with saved:
                case.run()
        else:
            case.run()
        sync(device_type)
    if device_type == "cuda":
        case.peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        case.peak_mb = rss.increase / 2**20
    case.saved_mb = saved.bytes / 2**20 if saved is not None else float("nan")


def run_group(cases: list[Case], device_type: str, warmup: int, steps: int):
    """Warm up, measure memory, then time `steps` steps of every case round-robin.

    The order of the cases is rotated every round, so drifts in machine load hit every case
    alike. Untimed steps per case: `warmup` (at least 1: the memory step). The memory step is
    the first step on CPU in eager mode (a fresh allocator shows the step's RSS growth), else
    the second (compilation, optimizer state and CUDA workspaces exist by then).
    """
    for c in cases:
        pre = 0 if device_type == "cpu" and c.mode == "eager" else 1
        for _ in range(pre):
            c.step()
        measure_memory(c, device_type, saved_bytes=c.mode == "eager")
    pre = 0 if device_type == "cpu" and all(c.mode == "eager" for c in cases) else 1
    untimed = max(0, warmup - pre - 1)
    for r in range(untimed + steps):
        order = cases[r % len(cases):] + cases[:r % len(cases)]  # rotate: no fixed position
        for c in order:
            c.zero()
            sync(device_type)
            t0, c0 = time.perf_counter(), time.process_time()
            c.run()
            sync(device_type)
            if r >= untimed:
                c.times.append(time.perf_counter() - t0)
                c.cpu_times.append(time.process_time() - c0)
