"""Shareable weights: a laplace checkpoint as a Hugging Face style model folder.

    python -m laplace.export checkpoint=runs/deit3/cifar100/vitb_12L_s0/ckpt/last.pt out=exports/vitb_12L
    model = laplace.load_model("exports/vitb_12L")         # or laplace.from_pretrained("org/name")
    timm.create_model("local-dir:exports/vitb_0L", pretrained=True)   # plain timm: a ViT without Laplacian heads

The folder holds model.safetensors (the state dict `load_model` loads), config.json (its "laplace"
node: format, version, the zoo model node that rebuilds the network, the tokenizer), README.md (a
model card, read by huggingface_hub's ModelCard) and, for a GPT with a trained BPE, tokenizer.json.
A ViT without Laplacian heads is timm's VisionTransformer: timm's own `save_for_hf` writes it, so
plain timm builds it; any other model names its zoo label as timm's `architecture` (vitt_3L),
which timm builds once `import laplace` has registered the zoo, and refuses in one line elsewhere
(Unknown model). Non-finite weights are refused before anything is written; the folder is written
aside and renamed into place (laplace.io).
"""
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from .checkpoint import (EXPORT_CARD, EXPORT_CONFIG, EXPORT_FORMAT, EXPORT_TOKENIZER, EXPORT_VERSION, EXPORT_WEIGHTS,
                         CheckpointError, check_finite, checkpoint_file, git, load_model, model_source, run_dir_of)
from .errors import ConfigError, UserError, cli_errors
from .io import atomic_dir
from .vit import VisionTransformer
from .zoo import model_label

CITATION = """@article{zhang2026laplacian,
  title   = {Laplacian Heads Improve Transformers by Smoothing Token Representations},
  author  = {Zhang, Yuchong and Papyan, Vardan},
  journal = {arXiv preprint arXiv:2602.09297},
  year    = {2026}
}"""
# timm's VisionTransformer that the zoo's widths are (every shape argument is given explicitly
# in config.json's model_args; the name only picks timm's defaults for the rest).
_TIMM_ARCHS = {"vitt": "vit_tiny_patch16_224", "vits": "vit_small_patch16_224",
               "vitb": "vit_base_patch16_224", "vitl": "vit_large_patch16_224"}
# The Hub's ids of the data nodes that have one (the card's `datasets`, which the Hub links).
HUB_DATASETS = {"imagenet": "ILSVRC/imagenet-1k", "cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100",
                "fineweb_edu": "HuggingFaceFW/fineweb-edu"}
_HEADER_KEYS = {"model", "num_laplacian_heads", "laplacian_mode", "attention", "dataset", "checkpoint"}
# How each kind of number in a results.json was measured (the card's protocol column): the first
# part of a `metrics_of` key, or the key itself; anything else is lm-eval's task/metric.
PROTOCOLS = {"final": "validation after the last training step", "best": "best validation during training",
             "knn": "weighted k-NN on frozen class tokens (DINO)", "linear": "linear probe on frozen features (DINO)",
             "mIoU": "linear segmentation head, frozen backbone (DINOv2)", "aAcc": "the same segmentation head",
             "mAcc": "the same segmentation head"}


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the exported folder `out` of a laplace checkpoint; returns it.

    Args:
        checkpoint: a laplace checkpoint (`<run>/ckpt/last.pt`) or its run folder.
        out: a new (or empty) folder, the export's own: never one above the checkpoint.
        overwrite: replace `out` where it is an export already (only that: never a run's folder).
    """
    # Every check comes before the first byte is written: a refused export leaves nothing behind.
    # The checkpoint's real path: a symlink's own folder is not the run its results are in.
    src, out = checkpoint_file(checkpoint).resolve(), Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; give a folder to write the export into")
    if out.resolve() in src.parents:  # replacing it would delete the run (issue 53)
        raise ConfigError(f"out={out} holds the checkpoint it would export ({src}); write the export into a "
                          f"folder of its own, e.g. out=exports/{src.parent.parent.name}")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"out={out} exists and is not empty; choose another folder or pass overwrite=true")
        if not _replaceable(out):
            raise ConfigError(f"out={out} is not a folder python -m laplace.export wrote (it holds "
                              f"{', '.join(sorted(p.name for p in out.iterdir())[:4])}); overwrite=true replaces "
                              f"only an export: choose another folder")
    source = model_source(src)  # a foreign or torn file: one line, before anything is written
    if source["kind"] != "checkpoint":
        raise ConfigError(f"checkpoint={checkpoint} is an {source['kind']} folder; pass a laplace checkpoint")
    ckpt, model = source["ckpt"], load_model(source)
    # A diverged run's weights must not be published (timm's logits check would blame timm for them).
    check_finite(model.state_dict(), f"checkpoint={src}", "nothing exported: export a finite checkpoint (an "
                 "earlier ckpt/step_<N>.pt, or retrain with a lower optim.lr)")
    node, data = dict(ckpt["config"]["model"]), ckpt["config"].get("data") or {}
    # A GPT carries its tokenizer: sampling from the folder alone needs it (eval.generate, users).
    tokenizer, tokenizer_file = (None, None) if isinstance(model, VisionTransformer) else _tokenizer(src, ckpt)
    # A k = 0 ViT is timm's own VisionTransformer: published as timm's, plain timm loads it.
    timm_arch, timm_args, why_not = timm_equivalent(model, node)
    # config.json's "laplace" node: what load_model rebuilds, and where the weights come from.
    info = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "model": node,
            "timm": timm_arch is not None, **({"timm_unsupported": why_not} if why_not else {}),
            **({"tokenizer": tokenizer} if tokenizer else {}), "source": _source(src, ckpt)}
    card = model_card(model, node, info, _results(src), timm_arch, data)
    if info["source"].get("stopped_early"):  # the card says it too
        print(f"[laplace] warning: {src} is step {info['source']['step']} of the {info['source']['stopped_early']} "
              f"its run planned: the run stopped early, and the export is of unfinished weights", file=sys.stderr)
    # Written aside and renamed into place, exclusively: a signal or error removes the half-written
    # folder, the next export removes what a SIGKILL left, and of two exports to one `out` the
    # second to finish is refused (laplace.io.atomic_dir).
    try:
        with atomic_dir(out, _replaceable if overwrite else None) as tmp:
            if timm_arch is None:
                _save(tmp, model, info, node, data)
            else:  # timm's own writer where timm builds the model, so that config.json is timm's
                _save_for_timm(tmp, model, info, timm_arch, timm_args, data)
            if tokenizer_file is not None:  # the file itself: the training machine's path means nothing elsewhere
                shutil.copyfile(tokenizer_file, tmp / EXPORT_TOKENIZER)
            (tmp / EXPORT_CARD).write_text(card, encoding="utf-8")
    except FileExistsError:
        raise ConfigError(f"out={out} was written by another export or program meanwhile; nothing replaced: "
                          f"choose another folder, or pass overwrite=true to replace an export") from None
    return out


def _replaceable(folder: Path) -> bool:
    """Whether `folder` is an export and holds nothing else: the one kind overwrite=true replaces."""
    try:
        node = json.loads((folder / EXPORT_CONFIG).read_text()).get("laplace")
    except (OSError, ValueError, AttributeError):  # no config.json, not JSON, not a JSON object
        return False
    return (isinstance(node, dict) and node.get("format") == EXPORT_FORMAT
            and {p.name for p in folder.iterdir()} <= {EXPORT_CONFIG, EXPORT_WEIGHTS, EXPORT_CARD, EXPORT_TOKENIZER})


def _save(folder: Path, model: nn.Module, info: dict, node: dict, data: dict) -> None:
    """model.safetensors and a config.json whose `architecture` (timm's key) is the zoo's label."""
    from safetensors.torch import save_model

    # save_model (not save_file): tensors the model shares are stored once, not refused.
    save_model(model, str(folder / EXPORT_WEIGHTS), metadata={"format": "pt"})
    # timm's keys too: `timm.create_model("local-dir:...")` builds the model wherever the zoo is
    # registered with timm (`import laplace`), and elsewhere names it (Unknown model (vitt_3L)).
    # The label, not the node's family ("vitt"): timm's registry holds "vitt_3L". A per-layer label
    # (vitt_1-2L) is no registered name: the family's name with the most heads stands in, and
    # model_args' per-layer num_laplacian_heads sets every layer.
    label = model_label(node, shape=False)  # a name timm's registry holds; model_args give the shape
    arch = label if "-" not in label else f"{label.rsplit('_', 1)[0]}_{max(node['num_laplacian_heads'])}L"
    # A ViT's input size and classes too, as timm's pretrained_cfg says them (timm's data config
    # would otherwise feed 224 px to a 32 px model).
    pe = model.patch_embed if isinstance(model, VisionTransformer) else None
    shape = {"input_size": [pe.proj.in_channels, *pe.img_size], "num_classes": model.num_classes} if pe else {}
    timm_keys = {"architecture": arch, "model_args": {k: v for k, v in node.items() if k != "name"},
                 "pretrained_cfg": {**_data_config(data), **shape}}
    (folder / EXPORT_CONFIG).write_text(json.dumps({**timm_keys, "laplace": info}, indent=2) + "\n")


def _tokenizer(src: Path, ckpt: dict) -> tuple[Optional[str], Optional[Path]]:
    """(what config.json records, the file to copy) for a GPT: "bytes" / "gpt2" (nothing to copy)
    or EXPORT_TOKENIZER, a copy of the run's trained BPE checked to be the one it trained with."""
    from .tokenizer import load_tokenizer

    spec = (ckpt["config"].get("data") or {}).get("tokenizer")
    if spec in (None, "bytes", "gpt2"):
        return spec or "bytes", None  # runs before data.tokenizer existed were byte-level
    # The file may have been retrained since the run (same path, other ranks): the run's data
    # identity holds the fingerprint of the one it trained with (train/gpt.py).
    trained = (ckpt.get("data_identity") or {}).get("tokenizer")
    try:
        same = trained is None or load_tokenizer(spec).fingerprint()[:16] == trained
    except UserError as e:  # gone (moved with the data) or damaged
        raise CheckpointError(f"checkpoint={src}: its tokenizer cannot go with the export ({e})") from None
    if not same:
        raise CheckpointError(f"checkpoint={src}: {spec} is not the tokenizer the run trained with (its fingerprint "
                              f"differs); put the run's tokenizer file back there")
    return EXPORT_TOKENIZER, Path(spec)


def _data_config(data: dict) -> dict:
    """The preprocessing the model was trained with (timm's data config), where the run says it."""
    return {k: v for k, v in (("mean", data.get("mean")), ("std", data.get("std")),
                              ("crop_pct", data.get("eval_crop_pct"))) if v is not None}


def timm_equivalent(model: nn.Module, node: dict) -> tuple[Optional[str], dict, Optional[str]]:
    """(timm architecture, its model_args, None) when timm's VisionTransformer is this model
    (a ViT without Laplacian heads, softmax or DIFF attention: same parameter names, class token without a position
    embedding, LayerScale, QK-norm, class-token pooling), else (None, {}, why not)."""
    label = model_label(node)
    if not isinstance(model, VisionTransformer):
        return None, {}, f"{label} is a language model (GPT); timm has no such architecture"
    if any(model.num_laplacian_heads):
        return None, {}, (f"{label} has Laplacian heads ({_k_text(model.num_laplacian_heads)} per layer); "
                          f"timm's VisionTransformer has none")
    if any(b.attn.laplacian_mode != "fixed" for b in model.blocks):
        return None, {}, f"{label} has learned Laplacian gates; timm's VisionTransformer has none"
    arm = node.get("attention", "softmax")
    if arm in ("xsa", "gated"):  # timm's ViT has neither (DIFF: its attn_layer="diff", the same class)
        return None, {}, f"{label} has {arm} attention; timm's VisionTransformer has no such layer"
    if model.global_pool != "token":  # timm's avg pool normalises after the mean (fc_norm), ours before
        return None, {}, f"{label} has a mean-pooled head; timm's normalises after pooling, this one before"
    blk = model.blocks[0]
    # Every shape argument explicitly: timm's name (vit_tiny_patch16_224) only picks defaults. The
    # model itself says whether it has QK-norm and LayerScale; LayerScale's start is any value, as
    # the weights replace it.
    args = dict(img_size=model.patch_embed.img_size[0], patch_size=model.patch_embed.patch_size[0],
                in_chans=model.patch_embed.proj.in_channels, embed_dim=model.embed_dim,
                depth=len(model.blocks), num_heads=blk.attn.num_heads,
                mlp_ratio=blk.mlp.fc1.out_features / model.embed_dim, num_classes=model.num_classes,
                qk_norm=model.qk_norm, init_values=1e-6 if model.layer_scale else None,
                class_token=True, no_embed_class=True, global_pool="token", reg_tokens=0,
                **({"attn_layer": "diff"} if arm == "diff" else {}))
    return _TIMM_ARCHS[node["name"][:4]], args, None


def _save_for_timm(folder: Path, model: nn.Module, info: dict, arch: str, args: dict, data: dict) -> None:
    """timm's own export (`save_for_hf`) of timm's model holding our weights: model.safetensors and
    timm's config.json, our "laplace" node in it."""
    import timm
    from timm.models import save_for_hf

    # license / tag: of the ImageNet weights the architecture name stands for, not of these
    t = timm.create_model(arch, pretrained=False, pretrained_cfg_overlay=dict(license=None, tag=None), **args)
    t.load_state_dict(model.state_dict(), strict=True)  # same parameter names: strict, no mapping
    x = torch.randn(1, args["in_chans"], args["img_size"], args["img_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(x), t.eval()(x)
    # The card says timm builds this model: a difference would be a bug of ours, never published.
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"timm's {arch} gives other logits than {type(model).__name__} "
                           f"(max |diff| {(ours - theirs).abs().max().item():.3g})")
    save_for_hf(t, str(folder), model_config={"laplace": info}, safe_serialization=True,
                data_config=_data_config(data) or None)


def _source(path: Path, ckpt: dict) -> dict:
    """Where the weights come from: the run and the file in it (not the absolute path: the folder
    is meant to be shared), its step, code revision, trainer, data and experiment."""
    config, run = ckpt["config"], run_dir_of(path).resolve()
    data = (config.get("data") or {}).get("name")
    # train.py names run dirs <runs>/<trainer>/<experiment or data>/<model>_s<seed>: the middle
    # part is an experiment where it is not the data's name, in that layout (not a run_dir= of the user's).
    trainer = (config.get("trainer") or {}).get("name")
    folder = Path(str(config["run_dir"])) if config.get("run_dir") else None
    exp = folder.parent.name if folder is not None and folder.parent.parent.name == trainer else None
    exp = exp if exp != data else None
    loop = ckpt.get("loop") or {}
    # the planned length, where the checkpoint records it (the engine's, since 2026-12-06)
    early = {"stopped_early": loop["total_steps"]} if (loop.get("step") or 0) < (loop.get("total_steps") or 0) else {}
    return {"run": run.name, "checkpoint": str(path.resolve().relative_to(run)),
            "step": loop.get("step"), "git_rev": ckpt.get("git_rev"),
            "trainer": trainer, "data": data, "experiment": exp, **early}


def code_url() -> Optional[str]:
    """The checkout's git remote (a clone's origin), when it is a plain https address: the card's
    link to the code. None elsewhere (no remote; an ssh or credential-bearing address)."""
    url = git("remote", "get-url", "origin") or ""
    return url.removesuffix(".git") if url.startswith("https://") and "@" not in url else None


def _results(checkpoint: Path) -> list[tuple[str, dict]]:
    """(path relative to the run, record) of the run's results.json files (the trainer's, and
    the evaluations' in eval/*/) that were measured on this checkpoint."""
    run, found = run_dir_of(checkpoint), []
    for p in [run / "results.json", *sorted(run.glob("eval/*/results.json"))]:
        try:
            rec = json.loads(p.read_text()) if p.is_file() else None
        except (OSError, ValueError):  # a results file being rewritten or broken: not ours to fix here
            continue
        if not (isinstance(rec, dict) and rec.get("checkpoint")):
            continue
        # The record's path was written from the run's cwd: resolved here it may point elsewhere,
        # so <ckpt dir>/<file> equal counts too (last.pt of another run sits in another run dir).
        where, ours = Path(str(rec["checkpoint"])), checkpoint.resolve()
        if where.resolve() == ours or where.parts[-2:] == ours.parts[-2:]:
            found.append((str(p.relative_to(run)), rec))
    return found


def metrics_of(record: dict) -> dict[str, float]:
    """The measured numbers of a results.json: the trainers' `final` / `best`, k-NN's and the
    linear probe's top-1 / top-5, segmentation's mIoU / aAcc / mAcc, lm-eval's task/metric."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    # step and rates are bookkeeping, not measurements
    out = {f"{group}/{k}": v for group in ("final", "best", "knn", "linear")
           for k, v in (record.get(group) or {}).items() if number(v) and k not in ("step", "lr", "base_lr")}
    return {**out, **{k: v for k, v in record.items() if (k in ("mIoU", "aAcc", "mAcc") or "/" in k)
                      and k not in _HEADER_KEYS and number(v)}}


def _k_text(ks: list[int]) -> str:
    return str(ks[0]) if len(set(ks)) == 1 else str(ks)


def model_card(model: nn.Module, node: dict, info: dict, results: list[tuple[str, dict]],
               timm_arch: Optional[str], data: dict) -> str:
    """README.md of the export: metadata the Hub reads (huggingface_hub's ModelCardData), then what
    the model is, how it was trained and measured, how to load it."""
    from huggingface_hub import ModelCardData

    # the title is the model's label (vitt_3L), not the node's family (vitt)
    name, src, vit = model_label(node), info["source"], isinstance(model, VisionTransformer)
    # a depth-0 model (tests, ablations) has no block to read heads or mode from
    ks, attn = model.num_laplacian_heads, (model.blocks[0].attn if len(model.blocks) else None)
    heads, mode = (attn.num_heads, attn.laplacian_mode) if attn is not None else (0, "fixed")
    task = ("image-classification" if model.num_classes else "image-feature-extraction") if vit else "text-generation"
    # The Hub's ids of the training data: the data node's own, or its sources' (the chat mixtures).
    sources = data.get("sources") if isinstance(data.get("sources"), dict) else {}
    datasets = [HUB_DATASETS[d] for d in [data.get("name")] if d in HUB_DATASETS]
    datasets += sorted({v for v in sources.values() if isinstance(v, str) and v.count("/") == 1})
    url = code_url()
    # What the Hub reads: MIT is the code's licence (the data's terms, e.g. ImageNet's, come on top);
    # library_name timm where timm loads the folder as it is, else laplace.
    meta = ModelCardData(license="mit", library_name="timm" if timm_arch else "laplace", pipeline_tag=task,
                         tags=["laplace", "laplacian-heads", "vision-transformer" if vit else "gpt", task],
                         datasets=datasets or None, repository=url)
    kind = "Vision Transformer" if vit else "GPT language model"
    # k = 0 everywhere is the paper's baseline: ordinary attention, no Laplacian head at all.
    what = (f"A {kind} with Laplacian heads ((I - P) V instead of P V in the last k heads of each layer; "
            f"Zhang & Papyan, arXiv:2602.09297)" if any(ks) else
            f"A {kind} with ordinary attention only (k = 0: the baseline of Zhang & Papyan, arXiv:2602.09297, "
            f"no Laplacian heads)")
    lines = ["---", meta.to_yaml(), "---", f"# {name}", "", f"{what}, trained with laplace"
             f"{f' ({url})' if url else ''}. License: MIT (the code's); the training data's terms apply too.",
             "", "## Model", ""]
    if vit:
        pe = model.patch_embed
        scale = "LayerScale" if model.layer_scale else "no LayerScale"
        pool = "class-token" if model.global_pool == "token" else "mean (patch tokens)"
        lines.append(f"- Architecture: ViT (DeiT-III style), width {model.embed_dim}, depth {len(model.blocks)}, "
                     f"{heads} heads, patch {pe.patch_size[0]}, input {pe.img_size[0]} px, "
                     f"{model.num_classes or 'no'} classes, {scale}, QK-norm {'on' if model.qk_norm else 'off'}, "
                     f"{pool} pooling")
    else:
        tok = info.get("tokenizer")
        lines += [f"- Architecture: nanochat GPT, width {model.width}, depth {model.depth}, {heads} heads, "
                  f"vocabulary {model.vocab_size}",
                  f"- Tokenizer: {'tokenizer.json in this folder' if tok == EXPORT_TOKENIZER else tok} "
                  f"(laplace.tokenizer.load_tokenizer)"]
    lines += [f"- Laplacian heads: k = {_k_text(ks)} of {heads} heads per layer"
              f"{f' (the last k; {mode} mode)' if any(ks) else ''}",
              f"- Parameters: {sum(p.numel() for p in model.parameters()):,}", "", "## Training", ""]
    if src.get("experiment"):
        exp = src["experiment"]
        lines.append(f"- Recipe: `experiment={exp}` (its recipe card: docs/recipes/{exp}.md in the laplace repository)")
    if src.get("stopped_early"):
        lines.append(f"- Stopped early: these weights are step {src['step']} of the {src['stopped_early']} the run "
                     f"planned, not its finished model")
    lines += [f"- {label}: {src[key]}" for key, label in (("trainer", "Trainer"), ("data", "Data"), ("step", "Steps"),
                                                          ("git_rev", "Code revision")) if src.get(key) is not None]
    # One row per measured number, with how it was measured (PROTOCOLS; anything else is lm-eval's).
    rows = [f"| {where} | {rec.get('dataset')} | {PROTOCOLS.get(k.split('/')[0], 'lm-eval (eval.lm)')} | {k} | "
            f"{v:.6g} |" for where, rec in results for k, v in metrics_of(rec).items()]
    if rows:
        lines += ["", "## Metrics", "", "| results | dataset | protocol | metric | value |", "|---|---|---|---|---|",
                  *rows]
    lines += ["", "## Usage", "", "```python", "import laplace",
              "model = laplace.from_pretrained(\"<this folder or its Hub id>\")", "```", ""]
    if timm_arch:
        lines += ["Without Laplacian heads this is timm's VisionTransformer, so timm loads it too:", "",
                  "```python", "import timm", "model = timm.create_model(\"local-dir:<this folder>\", pretrained=True)"
                  "  # or \"hf-hub:<Hub id>\"", "```"]
    elif vit:
        lines.append(f"timm builds it only where laplace's models are registered with timm: {info['timm_unsupported']}.")
    else:  # a GPT: timm has no language models, registered or not
        lines.append(f"timm does not load it: {info['timm_unsupported']}.")
    return "\n".join([*lines, "", "## Citation", "", "```bibtex", CITATION, "```", ""])


_USAGE = "usage: python -m laplace.export checkpoint=PATH out=DIR [overwrite=true]"
_KEYS = ("checkpoint", "out", "overwrite")


def main(argv: Optional[list[str]] = None) -> Path:
    """The command line (console script `laplace-export`): key=value arguments."""
    return cli_errors(_main)(sys.argv[1:] if argv is None else list(argv))


def _main(argv: list[str]) -> Path:
    # key=value parsed by OmegaConf (Hydra's values: overwrite=true is a bool) without a Hydra
    # config: an installed package has no configs/ folder, and the command has three keys.
    from omegaconf import OmegaConf

    if any(a in ("-h", "--help") for a in argv):
        print(_USAGE)
        raise SystemExit(0)
    for a in argv:
        if "=" not in a:
            raise ConfigError(f"argument {a!r} is not key=value; {_USAGE}")
        if a.split("=", 1)[0] not in _KEYS:
            raise ConfigError(f"unknown key {a.split('=', 1)[0]!r}; valid: {', '.join(_KEYS)} ({_USAGE})")
    args = OmegaConf.to_container(OmegaConf.from_dotlist(argv))
    for key in ("checkpoint", "out"):
        if args.get(key) in (None, ""):
            raise ConfigError(f"{key}= is required; {_USAGE}")
    overwrite = args.get("overwrite", False)
    if not isinstance(overwrite, bool):
        raise ConfigError(f"overwrite={overwrite!r}: choose true or false")
    out = export(str(args["checkpoint"]), str(args["out"]), overwrite=overwrite)
    print(f"[laplace] exported {args['checkpoint']} to {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
