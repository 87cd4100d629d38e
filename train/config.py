"""train.py's config: the `model` node of a zoo name, mandatory values as one line, every value's
rule (the schema, pydantic), the config flattener.

`model=<zoo name>` works for every name, including `gpt_d{depth}_{k}L` at any depth, which no folder
of YAML files covers: Hydra's `model` group is served by the config source in
hydra_plugins/laplace_zoo.py, which asks `model_node` here. A node holds the constructor arguments,
the data-dependent ones interpolated from the `data` node, so a run's config.yaml shows the whole
architecture; its `name` is the family ("vitb", "gpt") and k lives in `num_laplacian_heads` alone.
"""
import inspect
from typing import Literal, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from laplace.errors import ConfigError
from laplace.schema import (Count, Fraction, Model, Node, NonNegative, Patches, Rate, Size, Steps, Switch, allowed,
                            allowed_or_null)
from laplace.zoo import BUILDERS, model_defaults

# Keys a data node provides to the model (interpolations resolved when the config is used).
FROM_DATA = {"vit": {"num_classes": "${data.num_classes}", "img_size": "${data.img_size}",
                     "patch_size": "${data.patch_size}"},
             "gpt": {"vocab_size": "${data.vocab_size}", "max_seq_len": "${data.seq_len}"}}
# Arguments every node states (so `model.qk_norm=true` overrides a key that is there), valued by
# the builder's own defaults: its signature is their one source.
STATED = {"vit": ("laplacian_mode", "attention", "drop_path_rate", "drop_path_schedule", "init_values", "qk_norm",
                  "global_pool"),
          "gpt": ("laplacian_mode", "attention", "grad_checkpointing")}


def model_node(name: str) -> dict:
    """The Hydra `model` node of a zoo name (the zoo's one-line error if it is unknown)."""
    d = model_defaults(name)
    arch = d.pop("arch")
    params = inspect.signature(BUILDERS[arch]).parameters
    d.setdefault("num_laplacian_heads", 0)  # a family's node ("vitb"): no Laplacian head
    return {**d, **{k: params[k].default for k in STATED[arch]}, **FROM_DATA[arch]}


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
    try:  # OmegaConf walks the config in its order and stops at the first `???`
        OmegaConf.to_container(cfg, resolve=False, throw_on_missing=True)
    except MissingMandatoryValue as e:
        raise required_error(e.full_key) from None


def required_error(key: str) -> ConfigError:
    """The one line for a mandatory value left unset (eagerly here, or lazily by train.cli)."""
    return ConfigError(f"{key} is required: {REQUIRED_HINTS.get(key, f'add {key}=<value> to the command')}")


def required(cfg: DictConfig, key: str, usage: str):
    """`cfg[key]`, or for a `???` left unset one line: "<key> is required: <usage>"."""
    try:
        return cfg[key]
    except MissingMandatoryValue:
        raise ConfigError(f"{key} is required: {usage}") from None


def required_list(cfg: DictConfig, key: str, usage: str) -> list[str]:
    """A mandatory value that is one path or a list of them (`checkpoint=A` or `checkpoint=[A,B]`),
    as a list of strings."""
    value = required(cfg, key, usage)
    return [str(v) for v in (value if isinstance(value, (ListConfig, list, tuple)) else [value])]


class Trainer(Node):
    # torch.device would take any of its 20 device types; the engine runs on these
    device: allowed(str, "auto, cpu, cuda or cuda:<index>", pattern=r"^(auto|cpu|cuda(:\d+)?)$") = None
    amp: Switch = None
    compile: Switch = None
    global_batch_size: allowed_or_null(int, "a whole number >= 1, or null for optim=muon26's rule", ge=1) = None
    micro_batch_size: allowed_or_null(int, "a whole number >= 1, or null for the whole share", ge=1) = None
    num_workers: Size = None
    epochs: Steps = None
    max_steps: Steps = None
    log_every: Count = None
    eval_every: Steps = None
    ckpt_every: Steps = None
    keep_every: Steps = None
    stop_after: Steps = None
    progress: bool = None  # (init_head is checked where it is read, laplace.checkpoint.load_pretrained)
    resume: allowed(Literal["auto", "force"], "auto (refuse another configuration's checkpoint) or force") = None


class Optim(Node):
    # torch's AdamW refuses a negative lr only at construction, after the data; it takes a
    # negative weight decay silently (it trains, towards larger weights)
    lr: Rate = None
    weight_decay: NonNegative = None
    betas: allowed(list[Fraction], "two numbers in [0, 1), e.g. [0.9, 0.999]", min_length=2, max_length=2) = None
    eps: Rate = None
    grad_clip: allowed_or_null(float, "a number > 0, or null for no clipping", gt=0) = None
    grad_clip_mode: Literal["global", "group", "param"] = None
    # Muon + AdamW (optim=muon): a rate per parameter kind instead of lr
    matrix_lr: Rate = None
    embedding_lr: Rate = None
    unembedding_lr: Rate = None
    scalar_lr: Rate = None
    muon_weight_decay: NonNegative = None
    momentum: Fraction = None
    ns_steps: Count = None


class Data(Patches):
    seq_len: Count = None
    num_classes: Count = None


class Wandb(Node):
    mode: allowed_or_null(Literal["online", "offline", "disabled"],
                          "online, offline or disabled (or null: WANDB_MODE decides)") = None


class Logger(Node):
    wandb: Optional[Wandb] = None
    progress_interval: NonNegative = None  # seconds between progress lines off a terminal (0: every redraw)


class TrainConfig(Node):
    """train.py's config (configs/config.yaml and its groups). Data comes before the model: a
    model node's sizes interpolate the data node's, and the key to name is the one the user set."""
    seed: Size = None
    trainer: Trainer = None
    optim: Optim = None
    data: Data = None
    model: Model = None
    logger: Logger = None


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
