"""`python -m analysis`: the paper's token-geometry measurements of saved checkpoints.

    python -m analysis checkpoint=runs/deit3/digits/vitt_3L_s0/ckpt/last.pt
    python -m analysis checkpoint=[runs/.../vitt_0L_s0/ckpt/last.pt,runs/.../vitt_3L_s0/ckpt/last.pt] \\
        analysis_out=runs/compare pca_maps=8
    python -m analysis checkpoint=... data=cifar100 data.root=/data/cifar max_tokens=1000000 device=cuda
    python -m analysis checkpoint=exports/vitb_12L data=imagenet     # a folder python -m laplace.export wrote

Every default lives in configs/analysis.yaml. Each checkpoint (or exported folder) is rebuilt by
`laplace.load_model` and evaluated on the validation split of its own data node (or `data=`);
what is measured per layer and token kind is in analysis/geometry.py. For a checkpoint
<dir>/<name>.pt, written to <dir>/<name>_analysis/ (a folder per checkpoint, so last.pt and
step_N.pt do not overwrite each other's; `out=DIR`: DIR/<run folder>_<name>_analysis):
    analysis.json                      model, Laplacian heads, data node, settings, n tokens,
                                       throughput, results[kind][layer][metric group], mechanism
    {anova,collapse,spectrum}.{png,pdf}
    mechanism.md, mechanism.{png,pdf}  with mechanism=true (the default): does each head smooth the
                                       residual stream? (analysis/mechanism.py)
With several checkpoints, the same figures with all of them on shared axes and summary.json go to
`analysis_out` (default <dir of the first>/compare_analysis), and pca_maps.{png,pdf} too (one
checkpoint: its own folder). Every output folder is checked writable before the computation.
stdout: a line per checkpoint with its throughput and headline numbers, then `[analysis] wrote
<.../analysis.json>`; bad input exits with one `error: ...` line.
"""
from pathlib import Path

from omegaconf import DictConfig

import torch

from analysis.geometry import (analysis_dir, analyze_checkpoint, check_metrics, eval_split, geometry, layer_names,
                               load_for_analysis, model_facts)
from analysis.runs import expand
from laplace.checkpoint import run_dir_of
from train.cli import hydra_entry
from laplace.errors import ConfigError
from laplace.io import atomic_write, write_json
from train.rundir import check_writable
from train.logger import log_to_training_run


def headline(res: dict) -> dict:
    """The quick start's columns at the final norm (analysis.runs.geometry): within-sequence share
    and n_pcs_0.99 of the patch tokens (GPT: all tokens), NC1 of the class token (GPT: CDNV of
    next-token classes); None where not measured."""
    g = geometry(res)
    return {k: g.get(k) for k in ("within_seq_share", "n_pcs_0.99", "nc1" if res["arch"] == "vit" else "lc_cdnv_mean")}


def _checkpoints(cfg) -> list[Path]:
    return expand(cfg, "checkpoint", what="file", example="runs/gpt/study_lm/*/ckpt/step_*.pt",
                  usage="python -m analysis checkpoint=PATH (or checkpoint=[PATH1,PATH2] to compare, or a quoted glob "
                        "'runs/x/*/ckpt/last.pt')",
                  hint="pass checkpoint=PATH to a laplace checkpoint, e.g. runs/<trainer>/<data>/<run>/ckpt/last.pt, "
                       "or an exported folder")


def _out_dir(cfg, paths: list[Path]) -> Path:
    """Comparison figures and PCA maps: analysis_out, else out, else beside the (first) checkpoint."""
    # one checkpoint: its own folder holds its maps; several: a folder of their own, shared axes
    if cfg.analysis_out:
        return Path(cfg.analysis_out)
    if len(paths) == 1:
        return analysis_dir(paths[0], cfg.out)
    return Path(cfg.out) if cfg.out else paths[0].parent / "compare_analysis"


def _check_options(cfg, paths: list[Path], metrics: list) -> int:
    """Every option and output folder checked before the long part (a read-only run folder or a
    full disk would otherwise fail after all the computation); returns the mechanism's batch size."""
    if not isinstance(cfg.mechanism, bool):
        raise ConfigError(f"mechanism={cfg.mechanism}: true or false (the per-head smoothing diagnostic)")
    # the mechanism forms every head's P [B, H, N, N]: a smaller batch for long sequences
    bs = cfg.mechanism_batch_size
    if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
        raise ConfigError(f"mechanism_batch_size={bs}: a positive number of sequences, e.g. 8; null: batch_size")
    if metrics:
        dirs = [analysis_dir(p, cfg.out) for p in paths]
        if len(set(dirs)) < len(dirs):  # out= names folders <run>_<stem>_analysis: two runs of one name collide
            raise ConfigError(f"out={cfg.out}: two checkpoints would share an analysis folder; analyse them apart")
        for d in dirs:
            check_writable(d, "out")
    if len(paths) > 1 or cfg.pca_maps:
        check_writable(_out_dir(cfg, paths), "analysis_out" if cfg.analysis_out else "out")
    return int(bs or cfg.batch_size)


def _mechanism(model, data_node, cfg, batch_size: int, out: Path, res: dict) -> None:
    """The per-head diagnostic on the geometry's sequences (the same seed and max_tokens cut): into
    res["mechanism"], mechanism.md and (with figures) mechanism.{png,pdf} in `out`."""
    from analysis.mechanism import TYPES, draw_mechanism, mechanism_model, to_markdown

    dataset, _ = eval_split(model, data_node, cfg.seed, cfg.max_tokens)
    # it reruns the model with return_attn=True (every layer's P): in the residual stream's frame,
    # analysis/mechanism.py says what each number means
    res["mechanism"] = mech = mechanism_model(model, dataset, batch_size, cfg.num_workers, cfg.progress)
    atomic_write(out / "mechanism.md", to_markdown({"model": res["model"], **mech}).encode())
    if cfg.figures:
        draw_mechanism({"model": res["model"], **mech}, out / "mechanism")
    s = mech["summary"]
    # the line a reader checks first: do the Laplacian heads smooth (cos > 0, dshare < 0)?
    means = ", ".join(f"{k}.{t}={s[f'{k}.{t}']:+.3f}" for k in ("cos_smooth", "dshare")
                      for t in TYPES if f"{k}.{t}" in s)
    print(f"[analysis] mechanism: {mech['n_tokens']:,} tokens in {mech['seconds']:.1f} s; {means}", flush=True)


def _print_run(res: dict) -> None:
    # one line per checkpoint: what it cost (for planning a larger run) and its headline numbers
    thr = res["throughput"]
    heads = ", ".join(f"{k}={v:.4g}" for k, v in headline(res).items() if v is not None)
    mem = f", peak CUDA {thr['peak_cuda_mib']:,.0f} MiB" if "peak_cuda_mib" in thr else ""
    print(f"[analysis] {res['model']}: {res['n_tokens']:,} tokens ({res['n_sequences']:,} sequences) in "
          f"{thr['seconds']:.1f} s = {thr['tokens_per_s']:,.0f} tokens/s on {thr['device']}, peak RSS "
          f"{thr['peak_rss_mib']:,.0f} MiB{mem}" + (f"; at norm: {heads}" if heads else ""), flush=True)


def _labels(runs: list[dict], base, sep: str = " ") -> list[str]:
    """base(run) for each run, with its run folder where two runs share a model name (two seeds of
    one model would otherwise share a legend entry or a file name)."""
    names = [r["model"] for r in runs]
    return [base(r) + (f"{sep}{run_dir_of(r['checkpoint']).name}" if names.count(r["model"]) > 1 else "")
            for r in runs]


def run(cfg: DictConfig) -> list[dict]:
    """Analyse every checkpoint, write analysis.json and figures; return the results."""
    from analysis.figures import draw_all, run_label
    from analysis.pca_maps import check_options, checkpoint_maps

    # None: no foreground step; checked here, before the long part
    pca_threshold = check_options(cfg.pca_foreground, cfg.pca_threshold, cfg.pca_upsample)
    metrics = check_metrics(list(cfg.metrics))
    paths = _checkpoints(cfg)
    if cfg.skip_done and metrics:  # a re-run of a sweep's analyses (one interrupted) measures only what is missing
        done = [p for p in paths if (analysis_dir(p, cfg.out) / "analysis.json").is_file()]
        paths = [p for p in paths if p not in done]
        print(f"[analysis] skip_done: {len(done)} checkpoints analysed already, {len(paths)} to go", flush=True)
        if not paths:
            return []
    if cfg.cpu_threads:
        torch.set_num_threads(int(cfg.cpu_threads))  # fewer when other runs share the cores (the miniature's sweeps)
    # "all", an index, or a list of indices (a ListConfig to a plain list)
    layers = cfg.layers if isinstance(cfg.layers, (str, int)) else list(cfg.layers)
    if not metrics and not cfg.pca_maps:  # refused before any model loads
        raise ConfigError("metrics=[] and pca_maps=0: nothing to do; ask for metrics or pca_maps=<n>")
    mechanism_bs = _check_options(cfg, paths, metrics)
    runs, vits, kinds = [], {}, set()
    for p in paths:  # one model in memory at a time: a sweep of ViT-B checkpoints would not fit otherwise
        model, ckpt, data_node = load_for_analysis(p, cfg.get("data"), cfg.device)
        facts = {**model_facts(model, ckpt), "checkpoint": str(p)}
        # the comparison figures draw checkpoints on shared axes: one architecture and one split
        kinds.add((facts["arch"], data_node["name"]))
        if len(kinds) > 1:  # fail before the long part, not after it
            raise ConfigError("checkpoint=[...]: compare like with like: the checkpoints mix architectures or "
                              "datasets; pass data=<name> to evaluate all on one split, or analyse them apart")
        measured = layer_names(model, layers)[1]
        for key in ("spectrum_layer", "pca_layer"):  # a layer the figures need but the analysis skipped
            if cfg[key] not in measured:
                raise ConfigError(f"{key}={cfg[key]}: not a measured layer; choose one of {measured}")
        if facts["arch"] == "vit":  # what a PCA-map column's title needs
            vits[p] = facts
        elif cfg.pca_maps:
            print(f"[analysis] pca_maps: skipped for {p}, not a ViT", flush=True)
        if metrics:
            # the geometry of every layer in one pass (analysis/geometry.py), on the loaded model
            res = analyze_checkpoint(p, metrics=metrics, layers=layers, max_tokens=cfg.max_tokens,
                                     batch_size=cfg.batch_size, num_workers=cfg.num_workers, seed=cfg.seed,
                                     min_count=cfg.min_count, thresholds=list(cfg.thresholds),
                                     progress=cfg.progress, loaded=(model, ckpt, data_node),
                                     per_seq_max_sequences=cfg.per_seq_max_sequences)
            runs.append(res)
            _print_run(res)
            if cfg.mechanism:  # before analysis.json is written: it holds the result
                _mechanism(model, data_node, cfg, mechanism_bs, analysis_dir(p, cfg.out), res)
            print(f"[analysis] wrote {write_json(analysis_dir(p, cfg.out) / 'analysis.json', res, indent=1)}",
                  flush=True)
            log_to_training_run(p, headline(res), "analysis")  # when the checkpoint's run used W&B
            if cfg.figures:
                draw_all([(run_label(res), [res])], analysis_dir(p, cfg.out), cfg.spectrum_layer)
        del model
    if len(runs) > 1:  # several checkpoints on the same axes, and a summary of their headline numbers
        out, labels = _out_dir(cfg, paths), _labels(runs, run_label)
        if cfg.figures:
            draw_all([(label, [r]) for label, r in zip(labels, runs)], out, cfg.spectrum_layer)
        summary = [{"label": label, "model": r["model"], "checkpoint": r["checkpoint"],
                    "analysis": str(analysis_dir(r["checkpoint"], cfg.out) / "analysis.json"), **headline(r)}
                   for label, r in zip(labels, runs)]
        print(f"[analysis] wrote {write_json(out / 'summary.json', {'runs': summary}, indent=1)}", flush=True)
    if cfg.pca_maps and vits:
        # the same images head every column; two seeds of one model: their map files get the run folder
        facts = list(vits.values())
        stem = _out_dir(cfg, paths) / "pca_maps"
        checkpoint_maps(dict(zip(_labels(facts, run_label), vits)), stem, int(cfg.pca_maps), cfg.pca_layer,
                        pca_threshold, cfg.pca_upsample, cfg.device, cfg.seed, cfg.get("data"),
                        _labels(facts, lambda f: f["model"], "_"))
        print(f"[analysis] wrote {stem.with_suffix('.png')} and full-resolution maps in {stem}/", flush=True)
    return runs


main = hydra_entry("analysis")(run)


if __name__ == "__main__":
    main()
