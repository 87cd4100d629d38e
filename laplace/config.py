"""Hydra glue: one `model/<name>` config node per zoo name, generated from the zoo.

`model=vitb_12L` must work for every zoo name, including `gpt_d{depth}_{k}L` at any depth,
which no finite folder of YAML files covers. So the nodes are generated from
`laplace.zoo.model_defaults` (the single source of the architectures) and stored in Hydra's
ConfigStore: the listed names, plus any `model=` value on the command line.
Each node holds the constructor arguments, with data-dependent ones interpolated from the
`data` node, so the resolved config.yaml of a run shows the whole architecture.
Mandatory values are Hydra's `???` (`trainer.init_from` of a fine-tuning experiment):
`check_required` turns the first one left unset into a one-line error before anything runs.
"""
from __future__ import annotations

import inspect
import sys
from typing import Iterable

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import ConfigError
from .gpt import GPT
from .vit import VisionTransformer
from .zoo import list_models, model_defaults

# Keys a data node provides to the model (interpolations resolved when the config is used).
_VIT_FROM_DATA = {"num_classes": "${data.num_classes}", "img_size": "${data.img_size}",
                  "patch_size": "${data.patch_size}"}
_GPT_FROM_DATA = {"vocab_size": "${data.vocab_size}", "max_seq_len": "${data.seq_len}"}
# Constructor arguments every node states (so `model.qk_norm=true` overrides a key that is
# there), with the values of the constructor's own defaults: its signature is their one source.
_STATED = {"vit": (VisionTransformer, ("laplacian_mode", "drop_path_rate", "drop_path_schedule",
                                       "init_values", "qk_norm", "global_pool"), _VIT_FROM_DATA),
           "gpt": (GPT, ("laplacian_mode", "grad_checkpointing"), _GPT_FROM_DATA)}


def model_node(name: str) -> dict:
    """The Hydra `model` node of a zoo name (raises the zoo's one-line error if unknown)."""
    d = model_defaults(name)
    cls, stated, from_data = _STATED[d.pop("arch")]
    params = inspect.signature(cls).parameters
    return {"name": name, **d, **{k: params[k].default for k in stated}, **from_data}


# What a mandatory value takes, where "add <key>=<value>" says too little.
REQUIRED_HINTS = {
    "trainer.init_from": "this experiment fine-tunes a pre-trained model: set trainer.init_from=PATH "
                         "(a laplace checkpoint or a timm/DeiT-III state dict)",
}


def check_required(cfg: DictConfig) -> None:
    """One line naming the first mandatory value (`???`) the command line left unset.

    Without it the run would fail wherever the value is first read (after building the data)
    with OmegaConf's multi-line MissingMandatoryValue, or `cfg.get(key)` would quietly give None.
    Nothing is resolved, so an interpolation into the wrong data node still gets its own
    one-line error (the trainer's model / data fit check)."""
    key = next(_missing(OmegaConf.to_container(cfg, resolve=False)), None)
    if key is not None:
        raise required_error(key)


def required_error(key: str) -> ConfigError:
    """The one line for a mandatory value left unset (eagerly here, or lazily by laplace.cli)."""
    return ConfigError(f"{key} is required: {REQUIRED_HINTS.get(key, f'add {key}=<value> to the command')}")


def required(cfg: DictConfig, key: str, usage: str):
    """`cfg[key]`, or for a `???` left unset one line: "<key> is required: <usage>"."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        return cfg[key]
    except MissingMandatoryValue:
        raise ConfigError(f"{key} is required: {usage}") from None


def required_list(cfg: DictConfig, key: str, usage: str) -> list[str]:
    """A mandatory value that is one path or a list of them (`checkpoint=A` or `checkpoint=[A,B]`),
    as a list of strings."""
    value = required(cfg, key, usage)
    return [str(v) for v in (value if isinstance(value, (ListConfig, list, tuple)) else [value])]


def _missing(node, key: str = ""):
    """Dotted keys of the `???` values in a plain container, in the config's order."""
    if node == "???":
        yield key
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _missing(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _missing(v, f"{key}[{i}]")


def _argv_model_names(argv: Iterable[str]) -> list[str]:
    names = []
    for a in argv:
        if a.startswith("model="):
            names += [n for n in a.split("=", 1)[1].split(",") if n]
    return names


def register_model_configs(extra: Iterable[str] = ()) -> None:
    """Store a `model/<name>` node for every listed zoo name, `extra` names and `model=` values
    of sys.argv (multirun comma lists included)."""
    cs = ConfigStore.instance()
    for name in dict.fromkeys([*list_models(), *extra, *_argv_model_names(sys.argv[1:])]):
        cs.store(group="model", name=name, node=model_node(name))


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested plain config as {"a.b.c": leaf}: what resume compares and what pools seeds
    (analysis.runs). List leaves become tuples, so flat configs hash and compare as values."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = tuple(v) if isinstance(v, list) else v
    return out
