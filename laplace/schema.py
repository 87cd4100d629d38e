"""Values declared once: types, ranges and choices, checked with pydantic, each refusal one line.

    check_config(cfg, schema)                          # any config against a schema (train.config: train.py's)
    check_config(node, Model, "<file>: laplace.model.")  # a model node read from a file (an export)

A bad value is one line naming the key, the value and what is allowed
(`error: optim.lr=-0.1: give a number > 0`), where it used to be a traceback from deep inside
torch or timm, or a run that trained with it (optim.weight_decay=-1, trainer.amp=maybe). Keys not
declared pass, checked where they are read (a trainer's own keys, laplace.zoo's k range). The model
node is declared here, beside the models; the train config's other nodes in train/config.py.
"""
import json
from typing import Annotated, Any, Literal, Optional, Union, get_args

from omegaconf import DictConfig, OmegaConf
# pydantic rather than OmegaConf's structured configs (which Hydra has): those check types only,
# so every range (lr > 0, drop-path in [0, 1)) and cross-key rule (an image size divisible by the
# patch) would be an `if` of its own again; pydantic declares type, range and choice on the field.
# It comes with wandb already and is a dependency of its own in pyproject.
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError


def allowed(kind: Any, text: str, **limits) -> Any:
    """`kind` within pydantic's `limits` (ge, gt, lt, pattern), and the words an error gives for it."""
    # The words ride in the field's description, where `_one_line` finds them from the error's key.
    return Annotated[Annotated[kind, Field(**limits)] if limits else kind, Field(description=text)]


def allowed_or_null(kind: Any, text: str, **limits) -> Any:
    """As `allowed`, and null too (a default the code picks: `text` says which)."""
    return Annotated[Optional[Annotated[kind, Field(**limits)]], Field(description=text)]


# The kinds of value, each with the words its error gives.
Count = allowed(int, "a whole number >= 1", ge=1)
Size = allowed(int, "a whole number >= 0", ge=0)
Rate = allowed(float, "a number > 0", gt=0)
NonNegative = allowed(float, "a number >= 0", ge=0)
Fraction = allowed(float, "a number in [0, 1)", ge=0, lt=1)
Switch = allowed(Union[Literal["auto"], bool], "auto, true or false")
Steps = allowed_or_null(int, "a whole number >= 1, or null for the default", ge=1)
# k: one count for every layer or one per layer; its upper bound (the heads) is the model's check
Heads = allowed(Union[Annotated[int, Field(ge=0)], list[Annotated[int, Field(ge=0)]]],
                "a whole number >= 0, or one per layer ([k1, k2, ...])")


class Node(BaseModel):
    # Strict: "ten" is no integer and true no number; a lax check would pass (converted) what the
    # code then reads unconverted and chokes on. Extra keys (other nodes', a trainer's) pass.
    # Every field defaults to None, which pydantic does not check: a node may leave a key out.
    model_config = ConfigDict(strict=True, extra="allow")


def multiple(node: BaseModel, key: str, of: str) -> None:
    """`key` must be a multiple of `of` (both set): the one cross-key rule, stated once."""
    a, b = getattr(node, key, None), getattr(node, of, None)
    if isinstance(a, int) and isinstance(b, int) and b > 0 and a % b:  # b <= 0: its own field's error
        # (key, words): pydantic keeps the exception, and `_one_line` names the key from it
        raise ValueError(key, f"a multiple of {of}={b}")


class Patches(Node):
    # the patch grid must tile the image (timm's PatchEmbed asserted it, at the first forward):
    # a model node's and a data node's
    img_size: Count = None
    patch_size: Count = None

    @model_validator(mode="after")
    def _patches_tile_the_image(self):
        multiple(self, "img_size", "patch_size")
        return self


class Model(Patches):
    # The model node of a train config or an export (checkpoint.read_export_config). A drop-path of
    # 1.5 used to fail only at the first step (torch's bernoulli_), a depth of "two" inside the constructor.
    name: str = None
    depth: Count = None
    embed_dim: Count = None
    width: allowed_or_null(int, "a whole number >= 1, or null for 64 x depth", ge=1) = None
    num_heads: allowed_or_null(int, "a whole number >= 1, or null for the default", ge=1) = None
    num_laplacian_heads: Heads = None
    drop_path_rate: Fraction = None
    num_classes: Size = None
    mlp_ratio: Rate = None
    init_values: allowed_or_null(float, "a number >= 0, or null / 0 for no LayerScale", ge=0) = None
    qk_norm: bool = None
    vocab_size: allowed_or_null(int, "a whole number >= 1, or null for the tokenizer's", ge=1) = None
    max_seq_len: Count = None

    @model_validator(mode="after")
    def _heads_divide(self):
        multiple(self, "embed_dim", "num_heads")
        return self


def check_config(cfg: DictConfig | dict, schema: type[BaseModel], prefix: str = "") -> None:
    """Raise ConfigError, one line, for the first value of `cfg` (resolved) that `schema` refuses;
    `prefix` goes before the key (where the config came from)."""
    # Resolved: model sizes interpolate the data node's (${data.img_size}); a `???` left is
    # check_required's to report, so it stays as it is here.
    plain = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    try:
        schema.model_validate(plain)
    except ValidationError as e:
        # the first error only: one line, in the schema's order (data before model)
        raise ConfigError(prefix + _one_line(schema, e.errors()[0], plain)) from None


def _one_line(schema: type[BaseModel], error: dict, plain: dict) -> str:
    """`<key>=<value>: give <what is allowed>` for one of pydantic's errors."""
    keys, field, node = [], None, schema
    for part in error["loc"]:  # the declared keys, down to the field (a union's branch names end it)
        fields = node.model_fields if node is not None else {}
        if part not in fields:
            break
        keys.append(part)
        field = fields[part]
        node = next((a for a in (field.annotation, *get_args(field.annotation))
                     if isinstance(a, type) and issubclass(a, BaseModel)), None)
    ctx = error.get("ctx") or {}
    if isinstance(ctx.get("error"), ValueError) and len(ctx["error"].args) == 2:  # a cross-key rule
        key, rule = ctx["error"].args
        keys, text = [*keys, key], rule
    else:  # the field's own words, else pydantic's (a choice: "'auto' or 'force'")
        text = (field.description if field is not None else None) or ctx.get("expected") or error["msg"].lower()
    value = plain  # the value as the config holds it (pydantic's `input` is a union branch's part)
    for k in keys:
        value = value.get(k) if isinstance(value, dict) else None
    shown = value if isinstance(value, str) else json.dumps(value)  # as typed: true, null, [0.9]
    return f"{'.'.join(map(str, keys))}={shown}: give {text}"
