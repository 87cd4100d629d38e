"""Token geometry of one checkpoint: its evaluation data through `laplace.features`, folded into
the metrics of `analysis.metrics` / `analysis.streaming` layer by layer, in one pass.

Used by `python -m analysis` (analysis/__main__.py); also callable in-process:

    from analysis.geometry import analyze_checkpoint
    res = analyze_checkpoint("runs/.../ckpt/last.pt", max_tokens=100_000)
    res["results"]["patch"]["norm"]["anova"]["within_seq_share"]

Layers: "blocks.<i>" is the residual stream after block i, "norm" the final-norm output (what
the head reads); the two can disagree, so both are measured. Token kinds and metrics:

ViT `patch`: the patch tokens; sequence = image, label = the image's class.
    anova            within/between image and class parts (streamed): total, within_seq,
                     between_seq (= within_class + between_class), within_class, between_class,
                     each a per-token mean square (mean over tokens of a squared distance, see
                     `metrics.anova`), and their *_share of total.
    spectral         spectrum of the globally centred patch tokens (n_pcs_0.99, ...): one
                     covariance of all tokens of all images about their common mean.
    spectral_within  pooled within-image spectrum: every token minus its own image's mean, ONE
                     covariance of all those rows (how many directions the within-image
                     variation of the whole set spans; an integer count).
    spectral_per_seq per-image spectra averaged over images: each image's patch tokens centred on
                     their own mean, that image's spectrum counted alone (n_pcs_<t>,
                     effective_rank as in `metrics.spectrum_metrics`), then the mean over images
                     (a float; the first per_seq_max_sequences images, 1024 by default;
                     n_sequences = images averaged, n_no_variance = images whose tokens are all
                     equal, left out). The paper's "tokens of one image concentrate".
                     Our reading, a guess: the paper's non-integer 547.7 / 430.4 PCs are such an
                     average over sequences (or over seeds), not one pooled count.
    nc               Neural Collapse of the image means of the patch tokens (one row per image)
                     with the classifier head W, b: the paper's "sequence means form a simplex
                     ETF aligned with the classifier". The head reads the class token, so nc3/nc4
                     here measure alignment, not the model's own decisions.
    cdnv             over patch tokens, classes = image classes (streamed).
ViT `cls`: the class token, one row per image; at "norm" it is exactly what the head classifies.
    nc (NC1-NC4 with the head), cdnv, spectral; in memory (N_images x D per layer). No ANOVA:
    a one-token sequence has no within part.
GPT `tokens`: every position of a window; sequence = window, label = next-token id.
    anova -> sequence parts only (total, within_seq, between_seq and shares); nc / cdnv ->
    linguistic collapse (keys lc_*: next-token classes with >= min_count rows, unembedding =
    lm_head.weight; the NCC agreement would need a second pass and is left out); spectral ->
    global spectrum, spectral_within
    (pooled, window-centred) and spectral_per_seq (per window, mean over windows), as for the ViT;
    our tables put the paper's 547.7 -> 430.4 PCs beside spectral_per_seq (our reading).
Memory: per layer O(D^2 + (#sequences + #classes) D), plus the class tokens. The per-sequence
spectra cost one batched eigvalsh of [B, min(T, D), min(T, D)] per layer and batch
(throughput.per_seq_spectra_s, part of accumulate_s).
"""
from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Subset

from analysis.metrics import cdnv, neural_collapse
from analysis.spectra import spectral_decay
from analysis.streaming import GeometryAccumulator, SequenceSpectra
from laplace.checkpoint import load_checkpoint, model_from_checkpoint
from laplace.dist import resolve_device
from laplace.errors import ConfigError
from laplace.vit import VisionTransformer
from laplace.zoo import features, model_label

METRICS = ("anova", "nc", "cdnv", "spectral")
# A GPT's labels are next tokens, which vary within a window: its ANOVA has sequence parts only,
# and its collapse is linguistic collapse over next-token classes (both NC and CDNV asked -> lc)
_GPT_ACC = {"anova": "anova_seq", "nc": "lc", "cdnv": "lc", "spectral": "spectral"}
_ANOVA_KEYS = ("total", "within_seq", "between_seq", "within_class", "between_class")


def check_metrics(metrics: Sequence[str]) -> list[str]:
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise ConfigError(f"metrics: unknown metric {bad[0]!r}; choose from {list(METRICS)}, "
                          f"e.g. metrics=[anova,spectral]")
    return list(dict.fromkeys(metrics))


def checkpoint_data_node(ckpt_config: dict, data=None) -> dict:
    """The data node to evaluate on: `data` (a Hydra node or dict) if given, else the
    checkpoint's own."""
    # an explicit data node wins: e.g. a checkpoint trained on one split, measured on another
    if data is not None:
        return OmegaConf.to_container(data, resolve=True) if OmegaConf.is_config(data) else dict(data)
    if not ckpt_config.get("data"):
        raise ConfigError("the checkpoint's config has no data node; pass data=<name> (e.g. data=digits)")
    return dict(ckpt_config["data"])


def eval_split(model, data: dict, seed: int = 0, max_tokens: Optional[int] = None):
    """(dataset, tokens per sequence): a fixed random subset of the validation split.

    The order is a permutation seeded by `seed`, so every checkpoint sees the same images /
    windows and a max_tokens cut is not biased to the first classes of a sorted split.
    """
    if isinstance(model, VisionTransformer):
        from laplace.data.vision import build_vision_dataset

        # a ViT's position embedding fixes its image size: another size is refused, not resampled
        want = model.patch_embed.img_size[0]
        if data.get("img_size", want) != want:
            raise ConfigError(f"data.img_size={data['img_size']} but the checkpoint's model takes "
                              f"{want} px images; set data.img_size={want}")
        ds = build_vision_dataset(OmegaConf.create(data), train=False)
        # +1: the class token, which the token count includes
        per_seq = model.patch_embed.num_patches + 1
    else:
        per_seq = int(data["seq_len"])
        # windows of seq_len tokens; their targets are the next tokens (linguistic collapse's classes)
        if data.get("kind") == "shards":  # the validation shards of its pre-training data
            from laplace.data.shards import ShardWindows, list_shards

            ds = ShardWindows(list_shards(data["root"], "val"), per_seq)
        elif data.get("name") == "pydoc_text":
            from laplace.data.text import build_pydoc_text

            ds = build_pydoc_text(False, per_seq)
        else:
            raise ConfigError(f"data={data.get('name')}: GPT checkpoints are analysed on token shards "
                              f"(data=fineweb_edu, data=pydoc_bpe: set data.root) or data=pydoc_text")
    # whole sequences only (the ANOVA's within-sequence part needs them), at least one
    n = len(ds) if max_tokens is None else min(len(ds), max(1, int(max_tokens) // per_seq))
    # a seeded permutation: a max_tokens cut takes a random subset of a sorted split, and every
    # checkpoint gets the same one (paired comparisons measure the same tokens)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]
    return Subset(ds, order.tolist()), per_seq


def layer_names(model, layers="all") -> tuple[Optional[list[int]], list[str]]:
    """Block indices for laplace.features (None = all) and the layer names, "norm" last."""
    depth = len(model.blocks)
    if layers in (None, "all"):
        return None, [f"blocks.{i}" for i in range(depth)] + ["norm"]
    idx = [layers] if isinstance(layers, int) else list(layers)
    for i in idx:
        if not isinstance(i, int) or not -depth <= i < depth:
            raise ConfigError(f"layers={list(idx)}: {i!r} is not a block index of this {depth}-block "
                              f"model; use layers=all or integers in -{depth}..{depth - 1}")
    # negative indices count from the end; duplicates collapse
    ids = sorted({i % depth for i in idx})
    return ids, [f"blocks.{i}" for i in ids] + ["norm"]


def group_metrics(out: dict) -> dict:
    """Split one flat metric dict into {"anova", "nc", "cdnv", "lc", "spectral"} groups."""
    groups: dict = {}
    for k, v in out.items():
        # by key prefix: the streamed and in-memory metrics share their key names
        if k.startswith("lc_"):
            g = "lc"
        elif k.startswith("cdnv"):
            g = "cdnv"
        elif k.startswith(("n_pcs_", "effective_rank", "total_variance", "spectrum")):
            g = "spectral"
        elif k.split("_share")[0] in _ANOVA_KEYS:
            g = "anova"
        else:
            g = "nc"
        groups.setdefault(g, {})[k] = v
    return groups


class _Timer:
    """Wall time of a section; synchronises CUDA so the time lands where the work is."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.total = 0.0

    # CUDA runs asynchronously: a sync on entry and exit lands the time where the work is
    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.total += time.perf_counter() - self.t0


def _peak_rss_mib() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    # (the peak, not the current size: what a memory budget must hold)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@torch.no_grad()
def analyze_model(model, dataset, *, metrics: Sequence[str] = METRICS, layers="all",
                  batch_size: int = 64, num_workers: int = 0, min_count: int = 5,
                  thresholds: Sequence[float] = (0.9, 0.99), progress: bool = True,
                  per_seq_max_sequences: Optional[int] = 1024) -> dict:
    """Run `dataset` through `laplace.features` and measure every layer.

    Args:
        model: a ViT or GPT from `load_model`, already on its device, in eval mode.
        dataset: items (image, class) for a ViT, (window, next tokens) for a GPT.
        metrics: subset of METRICS (see the module docstring for what each means per kind).
        layers: "all" or block indices; "norm" is always measured.
        batch_size, num_workers: the DataLoader's (sequences per forward).
        min_count: GPT: next-token classes with fewer rows are left out of linguistic collapse.
        thresholds: explained-variance fractions for n_pcs_<t>.
        progress: tqdm bar over batches.
        per_seq_max_sequences: spectral_per_seq averages over the first this many sequences of
            `dataset` (None: all; 0: not measured); the rest of the metrics use every sequence.
    Returns {"layers", "results": {kind: {layer: {group: {...}}}}, "throughput": {...}}.
    """
    from tqdm.auto import tqdm

    metrics = check_metrics(metrics)
    dev = next(model.parameters()).device
    vit = isinstance(model, VisionTransformer)
    block_ids, names = layer_names(model, layers)
    D = model.embed_dim if vit else model.width
    acc_metrics = ([m for m in ("anova", "cdnv", "spectral") if m in metrics] if vit
                   else list(dict.fromkeys(_GPT_ACC[m] for m in metrics)))
    # The patch accumulator always keeps per-image sums: the image means feed patch NC.
    # one accumulator per layer: statistics of every layer in a single pass over the data
    accs = {n: GeometryAccumulator(D, acc_metrics, device=dev) for n in names}
    # per-sequence spectra (spectral_per_seq): every batch holds whole sequences
    seqs = ({n: SequenceSpectra(thresholds, per_seq_max_sequences) for n in names}
            if "spectral" in metrics and per_seq_max_sequences != 0 else {})
    # the class tokens are few (one per image): kept in memory for the in-memory NC and CDNV
    cls_rows: dict = {n: [] for n in names}
    cls_labels = []
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    fwd, fold, per_seq = _Timer(dev), _Timer(dev), _Timer(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    # (reported beside the final peak: the statistics' own memory is the difference)
    rss_before = _peak_rss_mib()  # torch, the model and the data set-up, before any statistics
    seen = tokens = 0
    t0 = time.perf_counter()
    for x, y in tqdm(loader, desc="features", disable=not progress, leave=False):
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        with fwd:
            feats = features(model, x, layers=block_ids)
        B, T = feats["norm"].shape[:2]
        sid = torch.arange(seen, seen + B, device=dev)
        with fold:
            for n in names:
                f = feats[n].float()
                if vit:
                    # a patch token's sequence is its image and its label the image's class
                    P = T - 1  # patch tokens follow the class token
                    accs[n].update(f[:, 1:].reshape(-1, D), sid.repeat_interleave(P), y.repeat_interleave(P))
                    if "nc" in metrics or "cdnv" in metrics or "spectral" in metrics:
                        cls_rows[n].append(f[:, 0].cpu())
                else:
                    # a GPT's every position, labelled by the token it predicts
                    accs[n].update(f.reshape(-1, D), sid.repeat_interleave(T), y.reshape(-1))
                if seqs:
                    with per_seq:
                        seqs[n].update(f[:, 1:] if vit else f)
        if vit:
            cls_labels.append(y.cpu())
        seen, tokens = seen + B, tokens + B * T
    pass_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    results = {"patch": {}, "cls": {}} if vit else {"tokens": {}}
    head = getattr(model, "head", None)
    W = getattr(head, "weight", None)
    b = getattr(head, "bias", None)
    labels = torch.cat(cls_labels) if cls_labels else None
    for n in names:
        if vit:
            results["patch"][n], results["cls"][n] = _finish_vit(accs[n], cls_rows.pop(n), labels, W, b,
                                                                 metrics, thresholds)
        else:
            results["tokens"][n] = _finish_gpt(accs[n], model.lm_head.weight, metrics, min_count, thresholds)
        if seqs:
            results["patch" if vit else "tokens"][n]["spectral_per_seq"] = seqs.pop(n).compute()
        accs[n] = None  # free the layer's statistics before the next one is finished
    compute_s = time.perf_counter() - t1
    thr = {"sequences": seen, "tokens": tokens, "seconds": pass_s, "tokens_per_s": tokens / max(pass_s, 1e-9),
           "forward_s": fwd.total, "accumulate_s": fold.total, "per_seq_spectra_s": per_seq.total,
           "compute_s": compute_s,
           "peak_rss_mib": _peak_rss_mib(), "peak_rss_before_pass_mib": rss_before, "device": str(dev)}
    if dev.type == "cuda":
        thr["peak_cuda_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
    return {"layers": names, "results": results, "throughput": thr}


def _finish_vit(acc, cls_rows, labels, W, b, metrics, thresholds):
    # the paper's ViT object: NC of the image means of the patch tokens (sequence means), beside the
    # class token's NC (what the head reads)
    patch = group_metrics(acc.compute(thresholds=thresholds)) if acc.metrics else {}
    if "spectral" in metrics:
        patch["spectral_within"] = acc.spectral(thresholds, center="sequence")
    if "nc" in metrics:
        _, means, seq_labels = acc.sequence_means()
        patch["nc"] = neural_collapse(means, seq_labels, weight=W, bias=b)
    cls = {}
    if cls_rows:
        x = torch.cat(cls_rows).to(acc.device)
        y = labels.to(acc.device)
        if "nc" in metrics:
            cls["nc"] = neural_collapse(x, y, weight=W, bias=b)
        if "cdnv" in metrics:
            cls["cdnv"] = cdnv(x, y)
        if "spectral" in metrics:
            cls["spectral"] = spectral_decay(x, thresholds)
    return patch, cls


def _finish_gpt(acc, unembedding, metrics, min_count, thresholds):
    try:
        out = acc.compute(unembedding=unembedding, min_count=min_count, thresholds=thresholds)
    # too few next-token classes with min_count rows: a config problem, said as one line
    except ValueError as e:
        if "min_count" in str(e) or "or more rows" in str(e):
            raise ConfigError(f"min_count={min_count}: {e}; lower min_count or raise max_tokens") from None
        raise
    groups = group_metrics(out)
    if "spectral" in metrics:
        groups["spectral_within"] = acc.spectral(thresholds, center="sequence")
    return groups


def load_for_analysis(path, data=None, device: str = "auto"):
    """(model on its device, checkpoint dict, data node): what every analysis of `path` needs.

    Args:
        path: a laplace checkpoint (e.g. runs/.../ckpt/last.pt).
        data: a data node (Hydra node or dict) to evaluate on; None: the checkpoint's own.
        device: auto | cpu | cuda.
    """
    # (a ViT-B checkpoint is hundreds of MB: not read twice)
    ckpt = load_checkpoint(path)  # read once: the model is built from the same dict
    data_node = checkpoint_data_node(ckpt["config"], data)
    return model_from_checkpoint(ckpt, resolve_device(device)), ckpt, data_node


def analyze_checkpoint(path, *, data=None, metrics: Sequence[str] = METRICS, layers="all",
                       max_tokens: Optional[int] = None, batch_size: int = 64, num_workers: int = 0,
                       device: str = "auto", seed: int = 0, min_count: int = 5,
                       thresholds: Sequence[float] = (0.9, 0.99), progress: bool = True,
                       loaded=None, per_seq_max_sequences: Optional[int] = 1024) -> dict:
    """Load a checkpoint with `load_model`, build its evaluation data and measure it.

    Args:
        path, data, device: as in `load_for_analysis`.
        max_tokens: about this many tokens (whole sequences, at least one); None: the whole split.
        seed: the fixed order of the split (the same subset for every checkpoint).
        loaded: the result of `load_for_analysis(path, ...)` when the caller has it already.
        The rest as in `analyze_model`.
    Returns the analysis.json content: model facts, data, settings, throughput, results.
    """
    model, ckpt, data_node = loaded or load_for_analysis(path, data, device)
    cfg = ckpt["config"]
    dataset, per_seq = eval_split(model, data_node, seed, max_tokens)
    out = analyze_model(model, dataset, metrics=metrics, layers=layers, batch_size=batch_size,
                        num_workers=num_workers, min_count=min_count, thresholds=thresholds,
                        progress=progress, per_seq_max_sequences=per_seq_max_sequences)
    counts = list(model.num_laplacian_heads)
    return {
        "checkpoint": str(Path(path).resolve()), "model": model_label(cfg["model"]),
        "arch": "vit" if isinstance(model, VisionTransformer) else "gpt",
        "num_heads": model.blocks[0].attn.num_heads,
        "num_laplacian_heads": counts[0] if len(set(counts)) == 1 else counts,
        "step": ckpt.get("loop", {}).get("step"), "data": data_node,
        "tokens_per_sequence": per_seq, "n_sequences": out["throughput"]["sequences"],
        "n_tokens": out["throughput"]["tokens"],
        "settings": {"metrics": list(metrics), "layers": layers if isinstance(layers, str) else list(layers),
                     "max_tokens": max_tokens, "batch_size": batch_size, "seed": seed,
                     "min_count": min_count, "thresholds": list(thresholds),
                     "per_seq_max_sequences": per_seq_max_sequences},
        **out,
    }
