"""The GPT's activation memory beside nanochat's (`python -m bench --sections gpt_memory`).

    python -m bench --sections gpt_memory --nanochat /tmp/ref_nanochat      # + nanochat's own gpt.py
    python -m bench --device cuda --sections gpt_memory --memory-depths 20 --gpt-batch-size 32 \\
        --seq-len 2048 --memory-cap-gib 79.6                                 # gpt_d20's micro batch, an 80 GB card

Saved bytes per token: what autograd keeps for backward of one training forward (loss included)
under bf16 autocast, each storage once and parameters left out (timing.SavedBytes), at two
sequences minus at one, per token: what one more token of micro batch costs, without a step's
constants (autocast's bf16 weight copies, the rotary tables). Exact and the same on every run.
At each depth of --memory-depths (width 64 x depth, heads of 128, --vocab-size, --seq-len): ours
at k = 0 and at half the heads Laplacian, that one with grad_checkpointing, and nanochat's GPT when
--nanochat names a folder holding its `nanochat/gpt.py` (karpathy/nanochat eec0c79, with the
common / muon / adamw modules it imports: a copy outside this repository, never vendored), its
`wte` cast to bf16 by hand as its init_weights does on CUDA.
CUDA also: the peak of whole training steps of ours at half the heads Laplacian, with and without
checkpointing (forward, backward, Muon + AdamW as
experiment=gpt_d20 trains; two steps, so the optimizer state exists) at --gpt-batch-size
sequences, torch.cuda.max_memory_allocated with weights, gradients and optimizer state;
torch.compile'd with --compile. --memory-cap-gib limits the process to that much of the card
(set_per_process_memory_fraction), so a larger card answers for a smaller one: a step that does
not fit is recorded as OOM.
"""
from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Optional

import torch

import laplace
from laplace.gpt import gpt_dims

from .timing import SavedBytes

TARGET_VS_NANOCHAT = 1.00


def nanochat_gpt(folder: str, depth: int, vocab: int, seq_len: int) -> torch.nn.Module:
    """nanochat's GPT at our depth's shapes, from its own code in `folder`."""
    if not (Path(folder) / "nanochat" / "gpt.py").is_file():
        raise SystemExit(f"error: --nanochat {folder}: no nanochat/gpt.py there; copy karpathy/nanochat's "
                         f"nanochat/ package (gpt.py, common.py, muon.py, adamw.py at eec0c79) into it")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    from nanochat.gpt import GPT, GPTConfig

    width, heads = gpt_dims(depth)
    model = GPT(GPTConfig(sequence_len=seq_len, vocab_size=vocab, n_layer=depth, n_head=heads,
                          n_kv_head=heads, n_embd=width))
    model.init_weights()
    model.transformer.wte.to(dtype=torch.bfloat16)  # what its init_weights does on CUDA
    return model


def tokens(batch: int, seq_len: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets [batch, seq_len] (nanochat's loss needs contiguous targets)."""
    idx = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def saved_bytes(model: torch.nn.Module, batch: int, seq_len: int, vocab: int, device) -> int:
    """Bytes autograd keeps for backward of one bf16-autocast training forward of `batch` sequences."""
    x, y = tokens(batch, seq_len, vocab, device)
    with SavedBytes(model) as saved, torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss = model(x, targets=y)
    del loss  # the graph goes; the count stays
    return saved.bytes


def saved_per_token(model, seq_len: int, vocab: int, device) -> float:
    return (saved_bytes(model, 2, seq_len, vocab, device) - saved_bytes(model, 1, seq_len, vocab, device)) / seq_len


def peak_step_gib(model, batch: int, seq_len: int, vocab: int, device, compiled: bool) -> Optional[float]:
    """CUDA: max_memory_allocated over two training steps (GiB), None if they run out of memory."""
    from .models import gpt_optimizers

    opts, _ = gpt_optimizers(model)
    net = torch.compile(model) if compiled else model
    x, y = tokens(batch, seq_len, vocab, device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        for _ in range(2):
            for o in opts:
                o.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = net(x, targets=y)
            loss.backward()
            for o in opts:
                o.step()
            del loss
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    except torch.OutOfMemoryError:
        peak = None
    model.zero_grad(set_to_none=True)
    return peak


def run(args) -> dict:
    """The section's record: one row per model and depth, ours against nanochat's."""
    dev, cuda = torch.device(args.device), torch.device(args.device).type == "cuda"
    if cuda and args.memory_cap_gib:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), dev)
    rows = []
    for depth in args.memory_depths:
        width, heads = gpt_dims(depth)
        half = heads // 2
        models = [(f"gpt_d{depth}_{k}L", k, False) for k in sorted({0, half})]
        models.append((f"gpt_d{depth}_{half}L", half, True))
        if args.nanochat:
            models.append(("nanochat eec0c79", None, False))
        for name, k, ckpt in models:
            torch.manual_seed(0)
            if k is None:
                model = nanochat_gpt(args.nanochat, depth, args.vocab_size, args.seq_len)
            else:
                model = laplace.create_model(name, vocab_size=args.vocab_size, max_seq_len=args.seq_len,
                                             grad_checkpointing=ckpt)
            model = model.to(dev).train()
            row = dict(depth=depth, width=width, heads=heads, name=name, k=k, grad_checkpointing=ckpt,
                       impl="nanochat" if k is None else "laplace",
                       saved_bytes_per_token=saved_per_token(model, args.seq_len, args.vocab_size, dev))
            if cuda and k == half:  # k = 0 keeps the same activations; one compile fewer
                peak = peak_step_gib(model, args.gpt_batch_size, args.seq_len, args.vocab_size, dev,
                                     "compiled" in args.modes)
                row.update(peak_gib=peak, oom=peak is None)
            rows.append(row)
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            print(f"[gpt_memory] depth {depth} {name}{' grad_checkpointing' if ckpt else ''}: "
                  f"{row['saved_bytes_per_token']:,.0f} saved bytes per token"
                  + (f", peak {'OOM' if row['oom'] else format(row['peak_gib'], '.1f') + ' GiB'}"
                     if 'oom' in row else ""), flush=True)
    return dict(dtype="bf16 autocast", vocab_size=args.vocab_size, seq_len=args.seq_len,
                batch=args.gpt_batch_size, cap_gib=args.memory_cap_gib, nanochat=args.nanochat,
                rows=rows, ratios=ratios(rows))


def ratios(rows: list[dict]) -> list[dict]:
    """Each of ours against nanochat's at the same depth (target <= 1.00; with checkpointing no
    verdict: it is far below, by design)."""
    out = []
    for ref in (r for r in rows if r["impl"] == "nanochat"):
        for r in rows:
            if r["impl"] == "laplace" and r["depth"] == ref["depth"]:
                x = r["saved_bytes_per_token"] / ref["saved_bytes_per_token"]
                out.append(dict(depth=r["depth"], num=r["name"] + (" grad_checkpointing" if r["grad_checkpointing"] else ""),
                                den=ref["name"], ratio=x, target=TARGET_VS_NANOCHAT,
                                met=None if r["grad_checkpointing"] else x <= TARGET_VS_NANOCHAT))
    return out

