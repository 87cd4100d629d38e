"""Token geometry of one checkpoint: its evaluation data through `laplace.features`, folded into
the accumulators of analysis/metrics.py layer by layer, in one pass. `python -m analysis` runs
it (analysis/__main__.py); in-process:

    from analysis.geometry import analyze_checkpoint
    res = analyze_checkpoint("runs/.../ckpt/last.pt", max_tokens=100_000)
    res["results"]["patch"]["norm"]["anova"]["within_seq_share"]

Layers: "blocks.<i>" is the residual stream after block i, "norm" the final-norm output (what the
head reads); the two can disagree, so both are measured. Token kinds (results[kind][layer][group]):

ViT `patch`: the patch tokens; sequence = image, label = the image's class.
    anova            total, within_seq, between_seq (= within_class + between_class), within_class,
                     between_class (per-token mean squares, `metrics.anova`) and their *_share
    spectral         spectrum of the globally centred patch tokens (n_pcs_0.99, ...)
    spectral_within  pooled within-image spectrum: ONE covariance of every token less its image's mean
    spectral_per_seq each image's own spectrum, averaged over the first per_seq_max_sequences images
                     (a float; the paper's "tokens of one image concentrate"; our reading, a guess:
                     its non-integer 547.7 / 430.4 PCs are such an average)
    nc               Neural Collapse of the image means of the patch tokens with the head W, b: the
                     paper's "sequence means form a simplex ETF aligned with the classifier"
    cdnv             over patch tokens, classes = image classes
ViT `cls`: the class token, one row per image (at "norm", what the head classifies): nc, cdnv, spectral.
GPT `tokens`: every position of a window; sequence = window, label = next-token id: anova (the
    sequence parts), lc (linguistic collapse over next-token classes with >= min_count rows,
    unembedding = lm_head.weight), spectral, spectral_within and spectral_per_seq as for the ViT.
"""
import math
import resource
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Subset

from analysis.metrics import GeometryAccumulator, SequenceSpectra, cdnv, neural_collapse, spectral_decay
from laplace.checkpoint import load_model, model_source, run_dir_of
from train.dist import resolve_device
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


def load_for_analysis(path, data=None, device: str = "auto"):
    """(model on its device, checkpoint dict, data node) of a laplace checkpoint or of a folder
    `python -m laplace.export` wrote; the data node is `data` (a Hydra node or dict) if given,
    else the one the checkpoint (or the export) recorded."""
    # the one loader's description: a checkpoint's dict, or an export's model, data and step
    src = model_source(path)
    ckpt = src["ckpt"]
    if data is not None:  # an explicit data node wins: e.g. a model trained on one split, measured on another
        data = OmegaConf.to_container(data, resolve=True) if OmegaConf.is_config(data) else dict(data)
    elif ckpt["config"].get("data"):
        data = dict(ckpt["config"]["data"])
    else:
        trained_on = (src.get("export", {}).get("source") or {}).get("data")
        raise ConfigError(f"checkpoint={path}: it records no data node; pass data=<name> "
                          f"(e.g. data={trained_on or 'digits'}) to say which validation split to measure")
    return load_model(src, resolve_device(device)), ckpt, data


def model_facts(model, ckpt: dict) -> dict:
    """The model's name, arch ("vit" or "gpt"), num_heads and num_laplacian_heads (one k per layer;
    one number when every layer has the same): what analysis.json and the figures' labels name."""
    k = list(model.num_laplacian_heads)
    return {"model": model_label(ckpt["config"]["model"]), "arch": "vit" if isinstance(model, VisionTransformer)
            else "gpt", "num_heads": model.blocks[0].attn.num_heads,
            "num_laplacian_heads": k[0] if len(set(k)) == 1 else k}


def analysis_dir(checkpoint, out=None) -> Path:
    """Where the analysis of one checkpoint goes: beside it, named after it; with `out`, in
    <out>/<run folder>_<name>_analysis (the checkpoint's folder may be read-only)."""
    p = Path(checkpoint)
    return p.parent / f"{p.stem}_analysis" if out is None else Path(out) / f"{run_dir_of(p).name}_{p.stem}_analysis"


def eval_split(model, data: dict, seed: int = 0, max_tokens: Optional[int] = None):
    """(dataset, tokens per sequence): a fixed random subset of the validation split."""
    if isinstance(model, VisionTransformer):
        # the checkpoint's evaluation transform (resize, centre crop, normalise): what the model saw in validation
        from laplace.data.vision import build_vision_dataset

        # a ViT's position embedding fixes its image size: another size is refused, not resampled
        want = model.patch_embed.img_size[0]
        if data.get("img_size", want) != want:
            raise ConfigError(f"data.img_size={data['img_size']} but the checkpoint's model takes "
                              f"{want} px images; set data.img_size={want}")
        ds = build_vision_dataset(OmegaConf.create(data), train=False)
        per_seq = model.patch_embed.num_patches + 1  # +1: the class token, which the token count includes
    else:
        from laplace.data.kinds import val_windows

        # windows of seq_len tokens; their targets are the next tokens (linguistic collapse's classes)
        ds, per_seq = val_windows(data), int(data["seq_len"])
    # whole sequences only (the ANOVA's within-sequence part needs them), at least one
    n = len(ds) if max_tokens is None else min(len(ds), max(1, int(max_tokens) // per_seq))
    # a seeded permutation: a max_tokens cut takes a random subset of a sorted split (not its first
    # classes), and every checkpoint gets the same one (paired comparisons measure the same tokens)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]
    return Subset(ds, order.tolist()), per_seq


def layer_names(model, layers="all") -> tuple[Optional[list[int]], list[str]]:
    """Block indices for laplace.features (None = all) and the layer names, "norm" last."""
    depth = len(model.blocks)
    # all blocks by default: the per-block tables and figures read every one
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
    """Split one flat metric dict into {"anova", "nc", "cdnv", "lc", "spectral"} groups (by key prefix)."""
    def group(k):  # by key prefix: the streamed and in-memory metrics share their key names
        if k.startswith(("lc_", "cdnv")):
            return k.split("_")[0]
        if k.startswith(("n_pcs_", "effective_rank", "total_variance", "spectrum")):
            return "spectral"
        return "anova" if k.split("_share")[0] in _ANOVA_KEYS else "nc"

    groups: dict = {}
    for k, v in out.items():
        groups.setdefault(group(k), {})[k] = v
    return groups


@torch.no_grad()
def analyze_model(model, dataset, *, metrics: Sequence[str] = METRICS, layers="all",
                  batch_size: int = 64, num_workers: int = 0, min_count: int = 5,
                  thresholds: Sequence[float] = (0.9, 0.99), progress: bool = True,
                  per_seq_max_sequences: Optional[int] = 1024) -> dict:
    """Run `dataset` through `laplace.features` and measure every layer.

    Args:
        model: a ViT or GPT from `load_model`, already on its device, in eval mode.
        dataset: items (image, class) for a ViT, (window, next tokens) for a GPT.
        metrics: subset of METRICS (the module docstring says what each means per kind).
        layers: "all" or block indices; "norm" is always measured.
        batch_size, num_workers: the DataLoader's (sequences per forward).
        min_count: GPT: next-token classes with fewer rows are left out of linguistic collapse.
        thresholds: explained-variance fractions for n_pcs_<t>.
        progress: tqdm bar over batches.
        per_seq_max_sequences: spectral_per_seq averages over the first this many sequences
            (None: all; 0: not measured); the other metrics use every sequence.
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
    # one accumulator per layer: every layer in a single pass over the data; the patch accumulator
    # always keeps per-image sums, whose means feed the patch NC
    accs = {n: GeometryAccumulator(D, acc_metrics, device=dev) for n in names}
    # per-sequence spectra (spectral_per_seq): every batch holds whole sequences
    seqs = ({n: SequenceSpectra(thresholds, per_seq_max_sequences) for n in names}
            if "spectral" in metrics and per_seq_max_sequences != 0 else {})
    # the class tokens are few (one per image): kept in memory for the in-memory NC and CDNV
    cls_rows: dict = {n: [] for n in names}
    cls_labels = []
    # the split's fixed order (no shuffle): every checkpoint of a comparison sees the same batches
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    if dev.type == "cuda":  # the pass's own peak, reported beside the throughput
        torch.cuda.reset_peak_memory_stats(dev)
    seen = tokens = 0
    t0 = time.perf_counter()
    for x, y in tqdm(loader, desc="features", disable=not progress, leave=False):
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        feats = features(model, x, layers=block_ids)
        B, T = feats["norm"].shape[:2]
        sid = torch.arange(seen, seen + B, device=dev)  # a sequence id per image / window, unique over batches
        for n in names:
            f = feats[n].float()
            if vit:
                # a patch token's sequence is its image and its label the image's class
                P = T - 1  # patch tokens follow the class token
                accs[n].update(f[:, 1:].reshape(-1, D), sid.repeat_interleave(P), y.repeat_interleave(P))
                if {"nc", "cdnv", "spectral"} & set(metrics):
                    cls_rows[n].append(f[:, 0].cpu())
            else:
                # a GPT's every position, labelled by the token it predicts
                accs[n].update(f.reshape(-1, D), sid.repeat_interleave(T), y.reshape(-1))
            if seqs:
                seqs[n].update(f[:, 1:] if vit else f)
        if vit:
            cls_labels.append(y.cpu())
        seen, tokens = seen + B, tokens + B * T
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # CUDA runs asynchronously: the pass's time includes its last kernels
    pass_s = time.perf_counter() - t0

    # finish layer by layer: each accumulator is freed before the next (their D x D scatters add up)
    results = {"patch": {}, "cls": {}} if vit else {"tokens": {}}
    W, b = (getattr(getattr(model, "head", None), k, None) for k in ("weight", "bias"))
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
    # the peak, not the current size: what a memory budget must hold (Linux reports KiB)
    thr = {"sequences": seen, "tokens": tokens, "seconds": pass_s, "tokens_per_s": tokens / max(pass_s, 1e-9),
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "device": str(dev)}
    if dev.type == "cuda":
        thr["peak_cuda_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
    return {"layers": names, "results": results, "throughput": thr}


def _finish_vit(acc, cls_rows, labels, W, b, metrics, thresholds):
    # the paper's ViT object: NC of the image means of the patch tokens (sequence means), beside the
    # class token's NC (what the head reads; there nc3 / nc4 are the model's own decisions)
    patch = group_metrics(acc.compute(thresholds=thresholds)) if acc.metrics else {}
    if "spectral" in metrics:
        patch["spectral_within"] = acc.spectral(thresholds, center="sequence")
    if "nc" in metrics:
        _, means, seq_labels = acc.sequence_means()
        patch["nc"] = neural_collapse(means, seq_labels, weight=W, bias=b)
    cls = {}
    if cls_rows:
        x, y = torch.cat(cls_rows).to(acc.device), labels.to(acc.device)
        if "nc" in metrics:
            cls["nc"] = neural_collapse(x, y, weight=W, bias=b)
        if "cdnv" in metrics:
            cls["cdnv"] = cdnv(x, y)
        if "spectral" in metrics:
            cls["spectral"] = spectral_decay(x, thresholds)
    return patch, cls


def _finish_gpt(acc, unembedding, metrics, min_count, thresholds):
    try:
        groups = group_metrics(acc.compute(unembedding=unembedding, min_count=min_count, thresholds=thresholds))
    except ValueError as e:  # too few next-token classes with min_count rows: a config problem, one line
        if "or more rows" in str(e):
            raise ConfigError(f"min_count={min_count}: {e}; lower min_count or raise max_tokens") from None
        raise
    if "spectral" in metrics:
        groups["spectral_within"] = acc.spectral(thresholds, center="sequence")
    return groups


def analyze_checkpoint(path, *, data=None, metrics: Sequence[str] = METRICS, layers="all",
                       max_tokens: Optional[int] = None, batch_size: int = 64, num_workers: int = 0,
                       device: str = "auto", seed: int = 0, min_count: int = 5,
                       thresholds: Sequence[float] = (0.9, 0.99), progress: bool = True,
                       loaded=None, per_seq_max_sequences: Optional[int] = 1024) -> dict:
    """Measure a checkpoint (or an exported folder) on its evaluation split: the analysis.json content.

    Args:
        path, data, device: as in `load_for_analysis`.
        max_tokens: about this many tokens (whole sequences, at least one); None: the whole split.
        seed: the fixed order of the split (the same subset for every checkpoint).
        loaded: the result of `load_for_analysis(path, ...)` when the caller has it already.
        The rest as in `analyze_model`.
    """
    model, ckpt, data_node = loaded or load_for_analysis(path, data, device)
    # the same seeded subset for every checkpoint: paired comparisons measure the same tokens
    dataset, per_seq = eval_split(model, data_node, seed, max_tokens)
    out = analyze_model(model, dataset, metrics=metrics, layers=layers, batch_size=batch_size,
                        num_workers=num_workers, min_count=min_count, thresholds=thresholds,
                        progress=progress, per_seq_max_sequences=per_seq_max_sequences)
    return {
        "checkpoint": str(Path(path).resolve()), **model_facts(model, ckpt),
        "step": ckpt.get("loop", {}).get("step"), "data": data_node,
        "tokens_per_sequence": per_seq, "n_sequences": out["throughput"]["sequences"],
        "n_tokens": out["throughput"]["tokens"],
        "settings": {"metrics": list(metrics), "layers": layers if isinstance(layers, (str, int)) else list(layers),
                     "max_tokens": max_tokens, "batch_size": batch_size, "seed": seed,
                     "min_count": min_count, "thresholds": list(thresholds),
                     "per_seq_max_sequences": per_seq_max_sequences},
        **out,
    }


# ----------------------------------------------------------------------------- reading analysis.json

def _finite(d: dict) -> dict:
    # a number or nothing: NaN (a sequence without variance) and non-numbers (lists, names) left out
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def geometry(analysis: dict, layer: str = "norm") -> dict:
    """Headline token geometry at one layer of one analysis.json ({} when not measured). Tokens:
    the ViT's patch tokens (sequence = image), the GPT's tokens (sequence = window). Keys:
        within_seq_share, between_seq_share, within_class_share, between_class_share (ANOVA)
        total_var, within_seq_var, ...  the raw parts, per-token mean squares (*_class: ViT only)
        n_pcs_<t>, effective_rank, total_variance   global spectrum (one covariance of all tokens)
        within_n_pcs_<t>          pooled within-sequence spectrum (tokens less their sequence's mean)
        per_seq_n_pcs_<t>, per_seq_effective_rank   each sequence's own, the mean over sequences
        nc1, nc2_*, nc3, nc4, cdnv_mean, cdnv_std   ViT: the class token (what the head classifies)
        patch_nc1, patch_nc2_*, ...  ViT: the image means of the patch tokens (the paper's object)
        lc_*                      GPT: linguistic collapse (classes = next-token ids)
    """
    vit = analysis.get("arch") == "vit"
    res = analysis.get("results", {})
    # the ViT's sequence geometry is of its patch tokens; the class token is a kind of its own
    at = res.get("patch" if vit else "tokens", {}).get(layer, {})
    anova = at.get("anova", {})
    g = {k: v for k, v in anova.items() if k.endswith("_share")}
    g.update({f"{k}_var": v for k, v in anova.items() if not k.endswith("_share")})
    g.update({k: v for k, v in at.get("spectral", {}).items() if k != "spectrum"})
    g.update({f"within_{k}": v for k, v in at.get("spectral_within", {}).items() if k.startswith("n_pcs")})
    g.update({f"per_seq_{k}": v for k, v in at.get("spectral_per_seq", {}).items()
              if k.startswith("n_pcs") or k == "effective_rank"})
    g.update(at.get("lc", {}))
    if vit:
        g.update({f"patch_{k}": v for k, v in at.get("nc", {}).items() if k.startswith("nc")})
        cls = res.get("cls", {}).get(layer, {})
        g.update({k: v for k, v in cls.get("nc", {}).items() if k != "num_classes"})
        g.update(cls.get("cdnv", {}))
    return _finite(g)


def layer_geometry(analysis: dict) -> dict:
    """`geometry` at every layer the analysis measured, in its order: {layer: {key: value}}."""
    return {layer: geometry(analysis, layer) for layer in analysis.get("layers", [])}


def mechanism_summary(analysis: Optional[dict]) -> dict:
    """The per-head smoothing diagnostic of one analysis.json pooled per head type (analysis/
    mechanism.py's summary, finite values only): {"<key>.<type>": mean over all layers,
    "blocks.<i>": {"<key>.<type>": ...}}; {} when the analysis ran without it."""
    s = ((analysis or {}).get("mechanism") or {}).get("summary") or {}
    return {**_finite(s), **{k: _finite(v) for k, v in s.items() if isinstance(v, dict)}}
