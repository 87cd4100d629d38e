"""The model zoo by name: `create_model("vitb_12L")`, `create_model("gpt_d20_5L")`, and `features`.

    vitt_{k}L   ViT-Tiny/16 (192 wide, 3 heads), k = 0..3 Laplacian heads in every layer
    vits_{k}L   ViT-S/16 (384, 6 heads), vitb_{k}L ViT-B/16 (768, 12 heads), vitl_{k}L ViT-L/16 (1024, 24 deep, 16 heads)
    gpt_d{depth}_{k}L   nanochat's GPT, 64 x depth wide, heads of 128 (d20: the paper's 561M LM, 10 heads)
    gpt26_d{depth}_{k}L nanochat's 2026 GPT (92d63d4, the first author's fork): GPT with GPT26's options

A model node (configs, checkpoints) names the family alone ("vitb", "gpt") and holds k in
`num_laplacian_heads` (an int or one count per layer): the one source of k. `model_label` derives
what runs, logs and tables call it. Importing laplace registers the ViT names with timm, so
`timm.create_model("vitb_12L")` works too.
"""
import fnmatch
import inspect
import numbers
import re
from functools import partial

import torch
import torch.nn as nn
from timm.models import build_model_with_cfg, register_model
from timm.models import vision_transformer as timm_vit

from .errors import ConfigError
from .gpt import GPT, block_indices, gpt_dims, rms_norm
from .vit import vit

# ViT shapes as timm / DeiT (patch 16, MLP 4x): the family names the width, depth and heads.
VIT_ARCHS = {
    "vitt": dict(embed_dim=192, depth=12, num_heads=3),
    "vits": dict(embed_dim=384, depth=12, num_heads=6),
    "vitb": dict(embed_dim=768, depth=12, num_heads=12),
    "vitl": dict(embed_dim=1024, depth=24, num_heads=16),
}
BUILDERS = {"vit": vit, "gpt": GPT}
# Listed by list_models() (4: experiment=gpt_tiny's; 3: the study's; 30: the authors' LoRA runs);
# `model=` takes any depth >= 1.
GPT_LISTED_DEPTHS = (2, 3, 4, 12, 20, 26, 30)
# nanochat 92d63d4's GPT as our GPT's options (its base_train defaults: SSSL windows, GQA off)
GPT26 = dict(round_width=True, window_pattern="SSSL", qk_scale=1.2, rope_base=100000.0, use_ve=True,
             use_resid_lambdas=True, use_x0=True, use_smear=True, use_backout=True, pad_vocab_to=64, init="2026",
             num_kv_heads=None)  # None: one kv head per head (stated, so `model.num_kv_heads=2` overrides it)
# The one parser of names: a zoo name ("vitb_12L", "gpt_d20_5L") or a node's family ("vitb", "gpt", "gpt26").
_NAME = re.compile(r"^(?:(?P<vit>vit[tsbl])|(?P<gpt>gpt(?:26)?)(?:_d(?P<depth>\d+))?)(?:_(?P<k>\d+)L)?$")


class UnknownModelError(ConfigError):
    """A model name the zoo does not know (or too many Laplacian heads for it)."""


def model_defaults(name: str) -> dict:
    """The constructor arguments a name stands for: {"arch": "vit" | "gpt", "name": family, ...}."""
    m = _NAME.match(str(name))
    if m is None or (m["depth"] and m["k"] is None):  # gpt_d20 needs its k ("gpt" alone is a family)
        vits = ", ".join(f"{a}_{{0..{c['num_heads']}}}L" for a, c in VIT_ARCHS.items())
        raise UnknownModelError(f"unknown model {name!r}; valid names: {vits}, "
                                f"gpt_d{{depth}}_{{k}}L or gpt26_d{{depth}}_{{k}}L with k <= heads "
                                f"(e.g. gpt_d20_{{0..10}}L)")
    if m["vit"]:
        cfg = dict(arch="vit", name=m["vit"], **VIT_ARCHS[m["vit"]])
        heads = cfg["num_heads"]
    else:
        cfg = dict(arch="gpt", name=m["gpt"], **(GPT26 if m["gpt"] == "gpt26" else {}))
        if m["depth"]:
            cfg["depth"] = int(m["depth"])
            if cfg["depth"] < 1:
                raise UnknownModelError(f"model {name!r}: depth must be >= 1")
        heads = gpt_dims(cfg.get("depth", 20), round_width=cfg.get("round_width", False))[1]
    if m["k"] is not None:
        cfg["num_laplacian_heads"] = k = int(m["k"])
        if k > heads:  # the models check k too (laplacian_counts); this names the name
            raise UnknownModelError(f"model {name!r} asks for {k} Laplacian heads but has only "
                                    f"{heads} heads per layer; use k in 0..{heads}")
    return cfg


def model_label(node, shape: bool = True) -> str:
    """A model node's name in run folders, logs and results: the family with the node's own k
    ("vitb_3L"; the GPT's family carries its depth, "gpt_d20_5L"; a ViT of another depth or width
    than its family's says so, "vitt_d2_w48_1L", unless `shape` is False). Per-layer counts join
    with "-" ("gpt_d12_0-0-6-6L") unless all equal. A node written before k moved out of the name
    ("name: vitb_12L") is read the same way; a name outside the zoo is returned as it is."""
    try:
        d = model_defaults(node["name"])
    except UnknownModelError:
        return str(node["name"])
    family = d["name"] if d["arch"] == "vit" else f"{d['name']}_d{node.get('depth', d.get('depth', 20))}"
    if d["arch"] == "vit" and shape:  # a 2-block, 48-wide net is no ViT-Tiny: results and legends say so
        family += "".join(f"_{c}{node[key]}" for key, c in (("depth", "d"), ("embed_dim", "w"), ("num_heads", "h"))
                          if node.get(key, d[key]) != d[key])  # analysis.runs.model_family's tags
    k = node.get("num_laplacian_heads", d.get("num_laplacian_heads", 0))
    if not isinstance(k, numbers.Integral):  # a per-layer list (ListConfig or list)
        ks = [int(x) for x in k]
        k = ks[0] if len(set(ks)) == 1 else "-".join(map(str, ks))
    return f"{family}_{k}L"


def create_model(name: str, **overrides) -> nn.Module:
    """Build a zoo model: a timm VisionTransformer (laplace.vit) or the GPT. `name` is a zoo name
    or a node's family; `overrides` replace any constructor argument (img_size, num_classes,
    drop_path_rate, vocab_size, num_laplacian_heads as a per-layer list, ...). None values are
    ignored, so a Hydra node may leave a key unset."""
    # the node's own values win over the name's defaults (k too: the node holds it)
    cfg = {**model_defaults(name), **{k: v for k, v in overrides.items() if v is not None}}
    cfg.pop("name")
    build = BUILDERS[cfg.pop("arch")]
    accepted = inspect.signature(build).parameters
    unknown = sorted(set(cfg) - set(accepted))
    if unknown:
        raise ConfigError(f"model {name!r} takes no argument {unknown[0]!r}; valid: {', '.join(accepted)}")
    return build(**cfg)


def list_models(pattern: str = "*") -> list[str]:
    """Zoo names matching a shell-style pattern, e.g. list_models("vitb_*")."""
    names = [f"{a}_{k}L" for a, c in VIT_ARCHS.items() for k in range(c["num_heads"] + 1)]
    names += [f"gpt_d{d}_{k}L" for d in GPT_LISTED_DEPTHS for k in range(gpt_dims(d)[1] + 1)]
    return [n for n in names if fnmatch.fnmatch(n, pattern)]


def features(model: nn.Module, x: torch.Tensor, layers=None, norm: bool = True) -> dict[str, torch.Tensor]:
    """Token representations [B, T, D] of a ViT (class token first) or a GPT, for the analyses and
    the frozen-feature evaluations: {"blocks.i": the residual stream after block i, for i in
    `layers` (None: all; negative: from the end), "norm": the final norm's output (what the head
    reads)}. A ViT's are timm's forward_intermediates (any timm VisionTransformer); blocks after the
    last one asked are skipped when `norm` is False."""
    if not isinstance(model, timm_vit.VisionTransformer):
        return model.forward_features(x, layers=layers, norm=norm)
    wanted = sorted(block_indices(layers, len(model.blocks)))
    if not wanted:
        return {"norm": model.forward_features(x)} if norm else {}
    # timm splits each block's output into patch and prefix (class) tokens: put them back together
    out = model.forward_intermediates(x, indices=wanted, return_prefix_tokens=True, output_fmt="NLC",
                                      stop_early=not norm, intermediates_only=not norm)
    final, blocks = out if norm else (None, out)
    feats = {f"blocks.{i}": torch.cat((prefix, patches), dim=1) for i, (patches, prefix) in zip(wanted, blocks)}
    return {**feats, "norm": final} if norm else feats


def embed(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tokens block 0 reads: a timm ViT's patches with their position embedding and the class
    token (timm's own steps), the GPT's normed token embeddings."""
    if isinstance(model, timm_vit.VisionTransformer):
        return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    return rms_norm(model.wte(x))


def _timm_entry(name: str):
    """timm's entry point for a zoo ViT: timm's builder around ours (a local-dir / hf-hub export's
    config.json and weights go through timm's own loading)."""
    def entry(pretrained: bool = False, **kwargs):
        # timm's builder: it applies a pretrained_cfg (num_classes, img_size) and loads its weights
        return build_model_with_cfg(partial(create_model, name), name, pretrained, **kwargs)

    entry.__name__ = entry.__qualname__ = name
    return entry


# timm's convention: an entry point is an attribute of its module, listed in its __all__.
__all__ = ["create_model", "embed", "features", "list_models", "model_defaults", "model_label"]
for _name in list_models("vit*"):
    globals()[_name] = register_model(_timm_entry(_name))
