"""The model zoo by name: `create_model("vitb_12L")`, `create_model("gpt_d20_5L")`.

Names:
    vitt_{k}L   ViT-Tiny  /16 (192 wide, 3 heads),  k = 0..3 Laplacian heads per layer
    vits_{k}L   ViT-Small /16 (384 wide, 6 heads),  k = 0..6
    vitb_{k}L   ViT-Base  /16 (768 wide, 12 heads), k = 0..12
    vitl_{k}L   ViT-Large /16 (1024 wide, 24 deep, 16 heads), k = 0..16
    gpt_d{depth}_{k}L   nanochat GPT, width 64 x depth, heads = ceil(width / 128), k = 0..heads
                        (d20 = the paper's 561M model with 10 heads; d12 for sweeps; d2 for tests)
The count k is per layer; a per-layer list can be passed as `num_laplacian_heads=[...]`.
"""
from __future__ import annotations

import fnmatch
import inspect
import numbers
import re

import torch.nn as nn

from .errors import ConfigError
from .gpt import GPT, gpt_dims
from .vit import VisionTransformer

# ViT shapes as timm / DeiT (patch 16, mlp 4x). The class token feeds the head.
VIT_ARCHS = {
    "vitt": dict(embed_dim=192, depth=12, num_heads=3),
    "vits": dict(embed_dim=384, depth=12, num_heads=6),
    "vitb": dict(embed_dim=768, depth=12, num_heads=12),
    "vitl": dict(embed_dim=1024, depth=24, num_heads=16),
}
GPT_LISTED_DEPTHS = (2, 3, 4, 12, 20, 26)  # listed by list_models() (3: the study's gpt_d3; 4: experiment=gpt_tiny's default); any depth >= 1 is accepted
_NAME = re.compile(r"^(?:(?P<vit>vit[tsbl])|gpt_d(?P<depth>\d+))_(?P<k>\d+)L$")


class UnknownModelError(ConfigError):
    """A model name the zoo does not know (or too many Laplacian heads for it)."""


def _valid_names_hint() -> str:
    ks = ", ".join(f"{a}_{{0..{c['num_heads']}}}L" for a, c in VIT_ARCHS.items())
    return f"valid names: {ks}, gpt_d{{depth}}_{{k}}L with k <= heads (e.g. gpt_d20_{{0..10}}L)"


def parse_name(name: str) -> tuple[str, int]:
    """A zoo name as (family, k): "vitb_12L" -> ("vitb", 12), "gpt_d20_5L" -> ("gpt_d20", 5).
    The only place a name is read; k is not checked against the heads here (see model_defaults)."""
    m = _NAME.match(name)
    if m is None:
        raise UnknownModelError(f"unknown model {name!r}; {_valid_names_hint()}")
    return name[:m.start("k") - 1], int(m["k"])


def model_defaults(name: str) -> dict:
    """The architecture arguments a name stands for: {"arch": "vit"|"gpt", **kwargs}."""
    family, k = parse_name(name)
    if family in VIT_ARCHS:
        cfg = dict(arch="vit", **VIT_ARCHS[family])
        heads = cfg["num_heads"]
    else:
        depth = int(family[len("gpt_d"):])
        if depth < 1:
            raise UnknownModelError(f"model {name!r}: depth must be >= 1")
        heads = gpt_dims(depth)[1]
        cfg = dict(arch="gpt", depth=depth)
    if k > heads:  # the range check itself is the models' (laplacian_counts); this one names the name
        raise UnknownModelError(f"model {name!r} asks for {k} Laplacian heads but has only "
                                f"{heads} heads per layer; use k in 0..{heads}")
    cfg["num_laplacian_heads"] = k
    return cfg


def model_label(node) -> str:
    """What a model node is called in run folders, logs and results: the family of its `name`
    with the node's own k, so `model=vitb_12L model.num_laplacian_heads=3` is "vitb_3L" (the node
    holds the architecture; the name only chose the config it started from). Per-layer counts
    join with "-" ("gpt_d12_0-0-6-6L") unless they are all equal; a name outside the zoo is
    returned as it is."""
    name = str(node["name"])
    try:
        family, k = parse_name(name)
    except UnknownModelError:
        return name
    k = node.get("num_laplacian_heads", k)
    if isinstance(k, numbers.Integral):
        k = int(k)
    else:  # a per-layer list (ListConfig or list)
        ks = [int(x) for x in k]
        k = ks[0] if len(set(ks)) == 1 else "-".join(map(str, ks))
    return f"{family}_{k}L"


def create_model(name: str, **overrides) -> nn.Module:
    """Build a zoo model. `overrides` replace any constructor argument (img_size, patch_size,
    num_classes, drop_path_rate, vocab_size, num_laplacian_heads as a per-layer list, ...);
    None values are ignored so Hydra nodes can leave a key unset."""
    cfg = model_defaults(name)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    cls = VisionTransformer if cfg.pop("arch") == "vit" else GPT
    accepted = inspect.signature(cls).parameters
    unknown = sorted(set(cfg) - set(accepted))
    if unknown:
        raise ConfigError(f"model {name!r} takes no argument {unknown[0]!r}; valid: "
                          f"{', '.join(accepted)}")
    return cls(**cfg)


def list_models(pattern: str = "*") -> list[str]:
    """Zoo names matching a shell-style pattern, e.g. list_models("vitb_*")."""
    names = [f"{a}_{k}L" for a, c in VIT_ARCHS.items() for k in range(c["num_heads"] + 1)]
    names += [f"gpt_d{d}_{k}L" for d in GPT_LISTED_DEPTHS for k in range(gpt_dims(d)[1] + 1)]
    return [n for n in names if fnmatch.fnmatch(n, pattern)]
