"""The step plan: how a run's global batch splits into micro batches and accumulation, and how many
optimizer steps an epoch and the whole run take.

One pure function of the config and the size of an epoch, `step_plan`, which the engine runs with
its feed's size and the recipe cards (train/recipe.py) with an assumed one, so a card's steps are
the steps a run takes. The global batch is a property of the recipe, not of the cluster: the split
(train.feeds.split_batch) adapts to the number of processes, the step count does not.
"""
import math
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from laplace.errors import ConfigError

from .feeds import split_batch


@dataclass(frozen=True)
class StepPlan:
    """A run's batch arithmetic and length on `world_size` processes.

    micro_batch: samples per process per forward; accum: micro batches per process per optimizer
    step (global batch = micro_batch x world size x accum). steps_per_epoch: optimizer steps in one
    epoch, None where the epoch's size is not known. total_steps: optimizer steps of the run, None
    where it counts epochs of unknown size. token_budget: the run's length is a token budget.
    """

    micro_batch: int
    accum: int
    steps_per_epoch: int | None
    total_steps: int | None
    token_budget: bool


def uses_token_budget(cfg: DictConfig) -> bool:
    """Pre-training on token shards (data.kind=shards, laplace/data/kinds.py): the run's length is
    a token budget, not epochs (image data nodes have no `kind`)."""
    return cfg.data.get("kind") == "shards"


def token_budget_steps(cfg: DictConfig) -> int:
    """Pre-training steps of a config without trainer.max_steps: the token budget
    (data.train_tokens, else trainer.tokens_per_param x parameters, nanochat's Chinchilla ratio)
    over the tokens of one step (global_batch_size x data.seq_len)."""
    tc, d = cfg.trainer, cfg.data
    if cfg.optim.get("horizon") is not None:  # optim=muon26: nanochat 92d63d4's horizon
        return nanochat_scaling(cfg).steps
    budget = d.train_tokens
    if budget is None:
        from laplace import create_model

        with torch.device("meta"):  # shapes only: no memory, no init
            budget = tc.tokens_per_param * sum(p.numel() for p in create_model(**cfg.model).parameters())
    return max(1, int(budget) // (tc.global_batch_size * d.seq_len))


def step_plan(cfg: DictConfig, world_size: int, micro_batches_per_epoch: int | None) -> StepPlan:
    """The step plan of `cfg` on `world_size` processes.

    Args:
        cfg: the composed training config (trainer.global_batch_size, micro_batch_size, max_steps,
            epochs; for a token budget also data and model).
        world_size: the number of processes.
        micro_batches_per_epoch: what the training feed gives each process in one epoch (its
            epochs end on a whole step, train/feeds.py); None: not known (a recipe card without data).

    The run's length: trainer.max_steps when set, else the token budget of token shards, else
    trainer.epochs epochs.
    """
    tc = cfg.trainer
    # The global batch is the recipe's; its split adapts to the number of processes.
    micro, accum = split_batch(tc.global_batch_size, tc.micro_batch_size, int(world_size))
    # A feed's epoch is whole steps (train/feeds.py): the division is exact but for tiny data (>= 1 step).
    spe = None if micro_batches_per_epoch is None else max(1, micro_batches_per_epoch // accum)
    budget = uses_token_budget(cfg)
    if tc.max_steps:  # an explicit length wins (smoke runs, nanochat's --num_iterations)
        total = int(tc.max_steps)
    elif budget:
        total = token_budget_steps(cfg)
    else:  # epochs; of unknown size (a recipe card without data): no total
        total = None if spe is None else tc.epochs * spe
    return StepPlan(micro, accum, spe, total, budget)


@dataclass(frozen=True)
class Scaling:
    """nanochat 92d63d4's horizon, batch and scales of a run (base_train.py, "Scaling laws and muP
    extrapolations"): params = its blocks' + lm_head's parameters (nanochat's transformer matrices +
    lm_head), reference_params the same of the reference model (d12), tokens nanochat's target tokens
    (ratio x params; params under a FLOPs budget, where only tokens / reference tokens counts), batch_tokens the tokens per step, steps the run's length (max_steps wins),
    lr_scale every rate's factor, muon_weight_decay Muon's scaled decay."""

    params: int
    reference_params: int
    tokens: int
    batch_tokens: int
    steps: int
    lr_scale: float
    muon_weight_decay: float


def scaling_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(("blocks.", "lm_head.")))


def nanochat_scaling(cfg: DictConfig) -> Scaling:
    """The Scaling of a config with optim=muon26 (its `horizon`, `reference`, batch_ref_tokens,
    batch_exponent; trainer.global_batch_size x data.seq_len, when set, is the batch)."""
    from laplace import create_model

    o, tc, seq_len = cfg.optim, cfg.trainer, cfg.data.seq_len
    with torch.device("meta"):  # shapes only; the reference derives its width and heads (kv too) from its depth
        model = create_model(**cfg.model)
        ref = {**cfg.model, "width": None, "num_heads": None, "num_kv_heads": None, **o.reference}
        n_ref = scaling_params(create_model(**ref))
    n, ratio, flops = scaling_params(model), o.horizon.param_data_ratio, o.horizon.flops
    if not (ratio or flops or tc.max_steps):
        raise ConfigError("optim.horizon: give param_data_ratio (e.g. 12) or flops (e.g. 1e18), or trainer.max_steps")
    # nanochat's D / D_ref; with a FLOPs budget its ratio is -1 in both, so it is n / n_ref
    r = ratio or 1
    tokens, ref_tokens = int(r * n), r * n_ref
    batch = tc.global_batch_size * seq_len if tc.global_batch_size else \
        2 ** round(math.log2(o.batch_ref_tokens * (tokens / ref_tokens) ** o.batch_exponent))
    if tc.max_steps:
        steps = int(tc.max_steps)
    elif flops:
        steps = round(flops / (model.flops_per_token(seq_len) * batch))
    else:
        steps = tokens // batch
    lr_scale = (batch / o.batch_ref_tokens) ** 0.5
    return Scaling(n, n_ref, tokens, batch, max(1, steps), lr_scale,
                   o.muon.weight_decay * lr_scale * ref_tokens / tokens)


def resolve_batch(cfg: DictConfig) -> DictConfig:
    """trainer.global_batch_size of optim=muon26 when null: nanochat's batch rule, in rows of
    data.seq_len (written into `cfg`, so the run's saved config holds it)."""
    if cfg.trainer.global_batch_size is None:
        if cfg.optim.get("horizon") is None:
            raise ConfigError(f"trainer.global_batch_size=null: only optim=muon26 derives the batch "
                              f"(optim={cfg.optim.name}); give the sequences per step")
        cfg.trainer.global_batch_size = max(1, nanochat_scaling(cfg).batch_tokens // cfg.data.seq_len)
    return cfg
