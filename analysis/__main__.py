"""`python -m analysis`: the paper's token-geometry measurements of saved checkpoints.

    python -m analysis checkpoint=runs/deit3/digits/vitt_3L_s0/ckpt/last.pt
    python -m analysis checkpoint=[runs/.../vitt_0L_s0/ckpt/last.pt,runs/.../vitt_3L_s0/ckpt/last.pt] \\
        analysis_out=runs/compare pca_maps=8
    python -m analysis checkpoint=... data=cifar100 data.root=/data/cifar max_tokens=1000000 device=cuda
    python -m analysis checkpoint=... metrics=[anova,spectral] layers=[0,5,-1] batch_size=256

Every default lives in configs/analysis.yaml. Each checkpoint is rebuilt by
`laplace.checkpoint.load_model` and evaluated on the validation split of its own data node
(or `data=`); what is measured per layer and token kind is in analysis/geometry.py.

Output, for a checkpoint <dir>/<name>.pt (a folder per checkpoint, so last.pt and step_N.pt
beside each other do not overwrite each other's results):
    <dir>/<name>_analysis/analysis.json      model, Laplacian heads, data node, settings, n tokens,
                                             throughput, results[kind][layer][metric group]
    <dir>/<name>_analysis/{anova,collapse,spectrum}.{png,pdf}
    <dir>/<name>_analysis/mechanism.md, mechanism.{png,pdf}   with mechanism=true (the default):
                                             does each head smooth the residual stream?
                                             (analysis/mechanism.py) per layer and head, in the
                                             stream's frame: cos(head's part, P x - x), the
                                             first-order change of the within-sequence variance
                                             and share, the eigen-mass of its matrix against the
                                             0.5 null; also in analysis.json as "mechanism"
With several checkpoints, the same figures with all of them on shared axes and summary.json
(headline numbers per checkpoint) go to `analysis_out` (default <dir of the first>/compare_analysis);
pca_maps.{png,pdf} go there too (one checkpoint: its own folder). `out=DIR` puts everything in DIR
instead (<run folder>_<name>_analysis per checkpoint), for checkpoints in read-only folders; every
output folder is checked writable before the computation. stdout has one line per
checkpoint with its throughput and headline numbers, then `[analysis] wrote <.../analysis.json>`.
Bad input (missing checkpoint, unknown metric, bad layer) exits with one `error: ...` line.
"""
from __future__ import annotations

import glob
from pathlib import Path

from omegaconf import DictConfig

from analysis.geometry import analyze_checkpoint, check_metrics, eval_split, layer_names, load_for_analysis
from laplace.checkpoint import run_dir_of
from laplace.cli import hydra_entry
from laplace.config import required_list
from laplace.errors import ConfigError
from laplace.io import write_json
from laplace.rundir import check_writable
from laplace.zoo import model_label
from train.logger import log_to_training_run

def analysis_dir(checkpoint, out=None) -> Path:
    """Where the analysis of one checkpoint goes: beside it, named after it; with `out`, in
    <out>/<run folder>_<name>_analysis (the checkpoint's folder may be read-only)."""
    p = Path(checkpoint)
    if out is None:
        return p.parent / f"{p.stem}_analysis"
    return Path(out) / f"{run_dir_of(p).name}_{p.stem}_analysis"


def headline(res: dict) -> dict:
    """The quick start's columns, all at the final-norm layer: within-sequence share and
    n_pcs_0.99 of the patch tokens (GPT: all tokens), NC1 of the class token (GPT: CDNV)."""
    kind = "patch" if res["arch"] == "vit" else "tokens"
    norm = res["results"][kind].get("norm", {})
    out = {"within_seq_share": norm.get("anova", {}).get("within_seq_share"),
           "n_pcs_0.99": norm.get("spectral", {}).get("n_pcs_0.99")}
    if res["arch"] == "vit":
        out["nc1"] = res["results"]["cls"].get("norm", {}).get("nc", {}).get("nc1")
    else:
        out["lc_cdnv_mean"] = norm.get("lc", {}).get("lc_cdnv_mean")
    return out


def _checkpoints(cfg) -> list[Path]:
    paths = []
    for item in required_list(cfg, "checkpoint", "python -m analysis checkpoint=PATH (or checkpoint=[PATH1,PATH2] "
                                                 "to compare, or a quoted glob 'runs/x/*/ckpt/last.pt')"):
        # a quoted glob: a sweep's checkpoints in one call (sorted: the same order every time)
        found = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        if not found:
            raise ConfigError(f"checkpoint={item}: the pattern matches no file; check it (quoted, e.g. "
                              f"checkpoint='runs/gpt/study_lm/*/ckpt/step_*.pt')")
        paths += [Path(p) for p in found]
    for p in paths:
        if not p.is_file():
            raise ConfigError(f"checkpoint={p}: no such file; pass checkpoint=PATH to a laplace checkpoint, "
                              f"e.g. runs/<trainer>/<data>/<run>/ckpt/last.pt")
    if not paths:
        raise ConfigError("checkpoint=[]: give at least one checkpoint path")
    return paths


def _labels(runs: list[dict]) -> list[str]:
    """Legend labels (set as r["label"]); the run folder is added where two checkpoints share a
    model name. `runs` need model, num_heads, num_laplacian_heads and checkpoint."""
    from analysis.plots import run_label

    names = [r["model"] for r in runs]
    for r in runs:
        r.pop("label", None)
        # two seeds of one model would otherwise share a legend entry
        if names.count(r["model"]) > 1:
            r["label"] = f"{run_label(r)} {Path(r['checkpoint']).parent.parent.name}"
    return [run_label(r) for r in runs]


def _facts(path, model, ckpt) -> dict:
    """What a legend needs about a checkpoint, when no metrics were measured."""
    k = list(model.num_laplacian_heads)
    return {"model": model_label(ckpt["config"]["model"]), "checkpoint": str(Path(path).resolve()),
            "num_heads": model.blocks[0].attn.num_heads, "num_laplacian_heads": k[0] if len(set(k)) == 1 else k}


def _print_run(res: dict) -> None:
    thr = res["throughput"]
    heads = ", ".join(f"{k}={v:.4g}" for k, v in headline(res).items() if v is not None)
    # one line per checkpoint: what it cost (for planning a larger run) and its headline numbers
    mem = f", peak CUDA {thr['peak_cuda_mib']:,.0f} MiB" if "peak_cuda_mib" in thr else ""
    print(f"[analysis] {res['model']}: {res['n_tokens']:,} tokens ({res['n_sequences']:,} sequences) in "
          f"{thr['seconds']:.1f} s = {thr['tokens_per_s']:,.0f} tokens/s on {thr['device']}, peak RSS "
          f"{thr['peak_rss_mib']:,.0f} MiB{mem}" + (f"; at norm: {heads}" if heads else ""), flush=True)


def _pca_images(model, data_node, cfg):
    """The first pca_maps images of the fixed order (the same for every checkpoint)."""
    import torch

    # no max_tokens: the PCA maps' images are the first of the fixed order, whatever the cut
    dataset, _ = eval_split(model, data_node, cfg.seed, None)
    n = min(int(cfg.pca_maps), len(dataset))
    items = [dataset[i] for i in range(n)]
    return torch.stack([x for x, _ in items]), [int(y) for _, y in items]


def _out_dir(cfg, paths: list[Path]) -> Path:
    """Comparison figures and PCA maps: analysis_out, else out, else beside the (first) checkpoint."""
    if cfg.analysis_out:
        return Path(cfg.analysis_out)
    if len(paths) == 1:
        return analysis_dir(paths[0], cfg.out)
    return Path(cfg.out) if cfg.out else paths[0].parent / "compare_analysis"


def _check_outputs(cfg, paths: list[Path], metrics: list) -> None:
    """Every folder the run will write, checked before the long part (a read-only run folder or a
    full disk would otherwise fail after all the computation)."""
    out = cfg.out
    if metrics:
        dirs = [analysis_dir(p, out) for p in paths]
        if len(set(dirs)) < len(dirs):
            # (out= names folders <run>_<stem>_analysis: two runs of one folder name would collide)
            raise ConfigError(f"out={out}: two checkpoints would share an analysis folder; analyse them apart")
        for d in dirs:
            check_writable(d, "out")
    if len(paths) > 1 or cfg.pca_maps:
        check_writable(_out_dir(cfg, paths), "analysis_out" if cfg.analysis_out else "out")


def _mechanism_options(cfg) -> tuple[bool, int]:
    """(mechanism on, its batch size), checked before the long part."""
    on, bs = cfg.mechanism, cfg.mechanism_batch_size
    if not isinstance(on, bool):
        raise ConfigError(f"mechanism={on}: true or false (the per-head smoothing diagnostic)")
    # the mechanism forms every head's P [B, H, N, N]: a smaller batch for long sequences
    if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
        raise ConfigError(f"mechanism_batch_size={bs}: a positive number of sequences, e.g. 8; null: batch_size")
    return on, int(bs or cfg.batch_size)


def _mechanism(model, data_node, cfg, batch_size: int, out: Path, res: dict) -> None:
    """The per-head diagnostic on the analysis' split: into res["mechanism"], mechanism.md and
    (with figures) mechanism.{png,pdf} in `out`."""
    from analysis.mechanism import draw_mechanism, mechanism_model, to_markdown
    from laplace.io import atomic_write

    # the same sequences as the geometry (the same seed and max_tokens cut)
    dataset, _ = eval_split(model, data_node, cfg.seed, cfg.max_tokens)
    # (in the residual stream's frame: analysis/mechanism.py says what each number means)
    mech = mechanism_model(model, dataset, batch_size, cfg.num_workers, cfg.progress)
    res["mechanism"] = mech
    atomic_write(out / "mechanism.md", to_markdown({"model": res["model"], **mech}).encode())
    if cfg.figures:
        draw_mechanism({"model": res["model"], **mech}, out / "mechanism")
    s = mech["summary"]
    means = ", ".join(f"{k}={s[k]:+.3f}" for k in ("cos_smooth.softmax", "cos_smooth.laplacian", "cos_smooth.learned",
                                                   "dshare.softmax", "dshare.laplacian", "dshare.learned") if k in s)
    print(f"[analysis] mechanism: {mech['n_tokens']:,} tokens in {mech['seconds']:.1f} s; {means}", flush=True)


def run(cfg: DictConfig) -> list[dict]:
    """Analyse every checkpoint, write analysis.json and figures; return the results."""
    from analysis import plots
    from analysis.pca_maps import check_options, denormalize, draw_pca_grid, model_maps
    from laplace.vit import VisionTransformer

    # None: no foreground step; checked here, before the long part
    pca_threshold = check_options(cfg.pca_foreground, cfg.pca_threshold, cfg.pca_upsample)

    metrics = check_metrics(list(cfg.metrics))
    mechanism, mechanism_bs = _mechanism_options(cfg)
    paths = _checkpoints(cfg)
    # (a checkpoint of a finished analysis keeps its analysis.json: a rerun after an interruption
    # resumes where it stopped)
    if cfg.skip_done and metrics:  # a re-run of a sweep's analyses measures only what is missing
        done = [p for p in paths if (analysis_dir(p, cfg.out) / "analysis.json").is_file()]
        paths = [p for p in paths if p not in done]
        print(f"[analysis] skip_done: {len(done)} checkpoints analysed already, {len(paths)} to go", flush=True)
        if not paths:
            return []
    if cfg.cpu_threads:
        import torch

        # (fewer threads when other runs share the cores, as the miniature's sweeps do)
        torch.set_num_threads(int(cfg.cpu_threads))
    # "all", an index, or a list of indices (a ListConfig to a plain list)
    layers = cfg.layers if isinstance(cfg.layers, (str, int)) else list(cfg.layers)
    if not metrics and not cfg.pca_maps:
        # (refused before any model loads)
        raise ConfigError("metrics=[] and pca_maps=0: nothing to do; ask for metrics or pca_maps=<n>")
    _check_outputs(cfg, paths, metrics)
    out = cfg.out
    runs, maps, map_facts, pca_images, kinds = [], [], [], None, set()
    for p in paths:
        loaded = load_for_analysis(p, cfg.get("data"), cfg.device)
        model, ckpt, data_node = loaded
        # the comparison figures draw checkpoints on shared axes: one architecture and one split
        vit = isinstance(model, VisionTransformer)
        kinds.add((vit, data_node["name"]))
        if len(kinds) > 1:  # fail before the long part, not after it
            raise ConfigError("checkpoint=[...]: compare like with like: the checkpoints mix architectures or "
                              "datasets; pass data=<name> to evaluate all on one split, or analyse them apart")
        measured = layer_names(model, layers)[1]
        # a layer the figures need but the analysis skipped would fail after all the work
        for key in ("spectrum_layer", "pca_layer"):
            if cfg[key] not in measured:
                raise ConfigError(f"{key}={cfg[key]}: not a measured layer; choose one of {measured}")
        if metrics:
            res = analyze_checkpoint(p, metrics=metrics, layers=layers, max_tokens=cfg.max_tokens,
                                     batch_size=cfg.batch_size, num_workers=cfg.num_workers, seed=cfg.seed,
                                     min_count=cfg.min_count, thresholds=list(cfg.thresholds),
                                     progress=cfg.progress, loaded=loaded,
                                     per_seq_max_sequences=cfg.per_seq_max_sequences)
            runs.append(res)
            _print_run(res)
            # (the mechanism reruns the model with return_attn=True: the attention maps P of every layer)
            if mechanism:  # before analysis.json is written: it holds the result
                _mechanism(model, data_node, cfg, mechanism_bs, analysis_dir(p, out), res)
            print(f"[analysis] wrote {write_json(analysis_dir(p, out) / 'analysis.json', res, indent=1)}", flush=True)
            # (nothing happens for runs logged to metrics.jsonl only)
            log_to_training_run(p, headline(res), "analysis")  # when the checkpoint's run used W&B
            if cfg.figures:
                plots.draw_all([res], analysis_dir(p, out), cfg.spectrum_layer)
        if cfg.pca_maps and vit:
            images, labels = _pca_images(model, data_node, cfg)
            # the same denormalised images head every column of the grid
            if pca_images is None:  # the image column: the same images for every checkpoint
                pca_images = (denormalize(images, data_node["mean"], data_node["std"]), labels)
            maps.append(model_maps(model, images, cfg.pca_layer, pca_threshold, cfg.pca_upsample))
            map_facts.append(_facts(p, model, ckpt))
        elif cfg.pca_maps:
            print(f"[analysis] pca_maps: skipped for {p}, not a ViT", flush=True)
        # one model in memory at a time: a sweep of ViT-B checkpoints would not fit otherwise
        del model, loaded
    if len(runs) > 1:
        _compare(runs, cfg, _out_dir(cfg, paths))
    if maps:
        stem = _out_dir(cfg, paths) / "pca_maps"
        # (two seeds of one model: their map files get the run folder in the name)
        models = [f["model"] for f in map_facts]  # file names: the model, + its run folder if shared
        names = [m if models.count(m) == 1 else f"{m}_{Path(f['checkpoint']).parent.parent.name}"
                 for m, f in zip(models, map_facts)]
        draw_pca_grid(pca_images[0], dict(zip(_labels(map_facts), maps)), stem, pca_images[1], cfg.pca_layer,
                      names, pca_threshold)
        print(f"[analysis] wrote {stem.with_suffix('.png')} and full-resolution maps in {stem}/", flush=True)
    return runs


def _compare(runs: list[dict], cfg, out: Path) -> None:
    """Several checkpoints on the same axes, and a summary of their headline numbers."""
    from analysis import plots

    _labels(runs)
    if cfg.figures:
        plots.draw_all(runs, out, cfg.spectrum_layer)
    summary = [{"label": plots.run_label(r), "model": r["model"], "checkpoint": r["checkpoint"],
                "analysis": str(analysis_dir(r["checkpoint"], cfg.out) / "analysis.json"), **headline(r)} for r in runs]
    print(f"[analysis] wrote {write_json(out / 'summary.json', {'runs': summary}, indent=1)}", flush=True)


main = hydra_entry("analysis")(run)


if __name__ == "__main__":
    main()
