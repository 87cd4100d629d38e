"""The shared training engine: every trainer (deit3, gpt, dino) is a subclass of `Trainer`.

The engine owns what is the same for all of them: device and distributed set-up, seeding,
batch arithmetic (global batch = micro batch x world size x accumulation), the optimizer and
its per-step learning-rate schedule, bf16 autocast and torch.compile, evaluation and
checkpoint cadence, exact resume and logging. A subclass supplies the data, the model, the loss
of one micro-batch and its evaluation:

    class MyTrainer(Trainer):
        def build_datasets(self): return train_set, val_set
        def train_step(self, batch): return loss, {"extra": value}
        def evaluate(self): return {"val_loss": ...}
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset

from laplace import create_model, dist
from laplace.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from laplace.data.sampler import ResumableSampler, SeededDataset, epoch_sampler
from laplace.logger import MetricsLogger
from laplace.optim import build_optimizer, lr_at, set_lr


class Trainer:
    """Step-based training loop with exact resume.

    Args:
        cfg: the resolved Hydra config (trainer, model, data, optim, logger, paths, seed,
            run_dir). `cfg.run_dir` must be set (train.py derives it from the command line).
    """

    #: what the throughput figure counts, and how many of them one training example holds
    unit = "samples"
    units_per_sample = 1

    def __init__(self, cfg: DictConfig):
        self.cfg, tc = cfg, cfg.trainer
        self.dist = dist.setup(tc.device)
        self.device = self.dist.device
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_path = self.run_dir / "ckpt" / "last.pt"
        self.amp = (tc.amp == "auto" and self.device.type == "cuda") or tc.amp is True
        dist.seed_everything(cfg.seed + self.dist.rank)

        # Batch arithmetic: the global batch is a property of the recipe, not of the cluster.
        world = self.dist.world_size
        self.micro_bs = tc.micro_batch_size or tc.global_batch_size // world
        if self.micro_bs < 1 or tc.global_batch_size % (self.micro_bs * world):
            raise ValueError(f"trainer.global_batch_size={tc.global_batch_size} is not a multiple of "
                             f"micro_batch_size ({self.micro_bs}) x world size ({world})")
        self.accum = tc.global_batch_size // (self.micro_bs * world)

        self.train_set, self.val_set = self.build_datasets()
        self.model = self.build_model().to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.train_loader = self._train_loader(self.train_set)
        self.steps_per_epoch = max(1, len(self.train_loader) // self.accum)
        self.total_steps = tc.max_steps or tc.epochs * self.steps_per_epoch
        o = cfg.optim
        self.warmup_steps = (o.warmup_steps if o.warmup_steps is not None
                             else round(o.warmup_epochs * self.steps_per_epoch))
        self.state = {"step": 0, "epoch": 0, "micro_in_epoch": 0}
        self.resumed = self._maybe_resume()

        # Wrappers last: the optimizer and checkpoints see the bare module (laplace.checkpoint.unwrap).
        self.net: nn.Module = self.model
        if self.dist.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.net = nn.parallel.DistributedDataParallel(self.net, device_ids=ids)
        if tc.compile:
            self.net = torch.compile(self.net)

    # ---- to implement in a trainer -------------------------------------------------------
    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        raise NotImplementedError

    def build_model(self) -> nn.Module:
        """The zoo model of the `model` node (a trainer may load weights into it)."""
        return create_model(**self.cfg.model)

    def train_step(self, batch) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch (under autocast) and extra floats to log."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        return {}

    def build_sampler(self, dataset: Dataset):
        """The epoch-seeded order of training samples (the DeiT trainer swaps in RepeatAug)."""
        return epoch_sampler(dataset, True, self.cfg.seed, self.dist.rank, self.dist.world_size)

    def collate(self, items):
        return torch.utils.data.default_collate(items)

    def on_fit_end(self, final_metrics: dict):
        """Called on every rank once training reached total_steps."""

    # ---- data ----------------------------------------------------------------------------
    def _loader_kwargs(self) -> dict:
        w = self.cfg.trainer.num_workers
        # An own generator: creating a loader iterator then draws no number from the global
        # RNG, so a resumed run's model randomness (drop-path, mixup) matches an uninterrupted one.
        return dict(num_workers=w, pin_memory=self.device.type == "cuda", persistent_workers=w > 0,
                    collate_fn=self.collate, generator=torch.Generator().manual_seed(self.cfg.seed))

    def _train_loader(self, dataset: Dataset) -> DataLoader:
        self.sampler = ResumableSampler(self.build_sampler(dataset), self.cfg.seed, self.dist.rank)
        return DataLoader(SeededDataset(dataset), batch_size=self.micro_bs, sampler=self.sampler,
                          drop_last=True, **self._loader_kwargs())

    def eval_loader(self, dataset: Dataset, batch_size: int | None = None) -> DataLoader:
        """Each rank gets every world_size-th sample (no padding, so sums over ranks are exact)."""
        shard = torch.utils.data.Subset(dataset, range(self.dist.rank, len(dataset), self.dist.world_size))
        return DataLoader(shard, batch_size=batch_size or self.micro_bs, shuffle=False,
                          **self._loader_kwargs())

    def _batches(self) -> Iterator:
        """Micro-batches forever, epoch after epoch, keeping `state` at what was consumed.

        The epoch counter moves on with the last batch of an epoch (not when the next one is
        asked for), so a checkpoint taken right after it resumes at the next epoch's start."""
        per_epoch = len(self.sampler.inner) // self.micro_bs
        while True:
            self.sampler.set_epoch(self.state["epoch"], self.state["micro_in_epoch"] * self.micro_bs)
            for batch in self.train_loader:
                self.state["micro_in_epoch"] += 1
                if self.state["micro_in_epoch"] == per_epoch:
                    self.state["epoch"] += 1
                    self.state["micro_in_epoch"] = 0
                yield batch

    def to_device(self, x):
        if isinstance(x, torch.Tensor):
            return x.to(self.device, non_blocking=True)
        if isinstance(x, (list, tuple)):
            return type(x)(self.to_device(v) for v in x)
        if isinstance(x, dict):
            return {k: self.to_device(v) for k, v in x.items()}
        return x

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp)

    # ---- checkpoints ---------------------------------------------------------------------
    def plain_config(self) -> dict:
        return OmegaConf.to_container(self.cfg, resolve=True)

    def save(self):
        rngs = dist.all_gather_object(rng_state())
        if self.dist.is_main:
            loop = dict(self.state, world_size=self.dist.world_size)
            save_checkpoint(self.ckpt_path, model=self.model, optimizer=self.optimizer,
                            loop=loop, rng=rngs, config=self.plain_config())
            keep = self.cfg.trainer.keep_every
            if keep and self.state["step"] % keep == 0:
                save_checkpoint(self.ckpt_path.with_name(f"step_{self.state['step']}.pt"),
                                model=self.model, optimizer=self.optimizer, loop=loop, rng=rngs,
                                config=self.plain_config())
        dist.barrier()

    def _maybe_resume(self) -> bool:
        if not self.ckpt_path.exists():
            return False
        ckpt = load_checkpoint(self.ckpt_path, map_location="cpu")
        self.model.load_state_dict(ckpt["model"], strict=True)
        self.optimizer.load_state_dict(ckpt["optimizer"])
        loop = dict(ckpt["loop"])
        saved_world = loop.pop("world_size", 1)
        self.state.update(loop)
        if ckpt.get("rng") and saved_world == self.dist.world_size:
            set_rng_state(ckpt["rng"][self.dist.rank])
        else:  # a different world size cannot continue each rank's stream; reseed by step
            dist.seed_everything(self.cfg.seed + self.dist.rank + 7919 * self.state["step"])
        return True

    # ---- the loop ------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg, tc = self.cfg, self.cfg.trainer
        main = self.dist.is_main
        logger = MetricsLogger(self.run_dir, enabled=main,
                               wandb_cfg=OmegaConf.to_container(cfg.logger.wandb) if cfg.logger.get("wandb") else None,
                               config=self.plain_config(),
                               resume_step=self.state["step"] if self.resumed else None)
        if main:
            print(f"[laplace] run_dir={self.run_dir} {'resumed at step ' + str(self.state['step']) if self.resumed else 'new run'}; "
                  f"{self.total_steps} steps ({self.steps_per_epoch}/epoch), global batch "
                  f"{tc.global_batch_size} = {self.micro_bs} x {self.dist.world_size} x {self.accum} accum, "
                  f"device {self.device}, bf16 {self.amp}")
        eval_every = tc.eval_every or self.steps_per_epoch
        ckpt_every = tc.ckpt_every or self.steps_per_epoch
        stop_at = self.total_steps if not tc.get("stop_after") else min(
            self.total_steps, self.state["step"] + tc.stop_after)
        bar = None
        if main and tc.progress:
            from tqdm import tqdm
            bar = tqdm(total=self.total_steps, initial=self.state["step"], dynamic_ncols=True)
        batches = self._batches()
        o = cfg.optim
        t0, seen, window_loss, window_n = time.perf_counter(), 0, 0.0, 0
        metrics = {}
        while self.state["step"] < stop_at:
            step = self.state["step"]
            self.net.train()
            lr = lr_at(step, lr=o.lr, total_steps=self.total_steps, warmup_steps=self.warmup_steps,
                       warmup_lr=o.warmup_lr, min_lr=o.min_lr, schedule=o.schedule)
            set_lr(self.optimizer, lr)
            # Losses stay on the device until logged: no host sync per micro-batch.
            loss_sum, extras = torch.zeros((), device=self.device), {}
            for micro in range(self.accum):
                batch = self.to_device(next(batches))
                sync = micro == self.accum - 1 or not self.dist.distributed
                with (contextlib.nullcontext() if sync else self.net.no_sync()), self.autocast():
                    loss, extra = self.train_step(batch)
                (loss / self.accum).backward()
                loss_sum += loss.detach().float() / self.accum
                for k, v in extra.items():
                    extras[k] = extras.get(k, 0.0) + v / self.accum
                seen += self.micro_bs * self.dist.world_size * self.units_per_sample
            if o.grad_clip:
                extras["grad_norm"] = nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.state["step"] = step = step + 1
            window_loss, window_n = window_loss + loss_sum, window_n + 1

            if step % tc.log_every == 0 or step == stop_at:
                dt = time.perf_counter() - t0
                # Averaged over ranks (all reach this line at the same step): the logged loss is
                # the global batch's, whatever the world size.
                window_loss = dist.all_reduce_mean(torch.as_tensor(window_loss, device=self.device))
                mean_loss = float(window_loss) / window_n
                if not math.isfinite(mean_loss):
                    raise FloatingPointError(f"training loss is {mean_loss} at step {step}; lower "
                                             f"optim.lr or set optim.grad_clip")
                rec = {"loss": mean_loss, "lr": lr, f"{self.unit}_per_s": seen / dt,
                       "epoch": self.state["epoch"], **{k: float(v) for k, v in extras.items()}}
                logger.log(step, rec, split="train")
                if bar is not None:
                    bar.set_postfix(loss=f"{mean_loss:.4f}", **{f"{self.unit}/s": f"{seen / dt:.0f}"})
                t0, seen, window_loss, window_n = time.perf_counter(), 0, 0.0, 0
            if bar is not None:
                bar.update(1)
            if step % eval_every == 0 or step == self.total_steps:
                metrics = self._evaluate(logger, step)
            if step % ckpt_every == 0 or step == stop_at:
                self.save()
        if bar is not None:
            bar.close()
        if self.state["step"] >= self.total_steps:
            if not metrics:  # resumed at the very end: evaluate the final weights once more
                metrics = self._evaluate(logger, self.state["step"])
            self.on_fit_end(metrics)
        logger.finish()
        return metrics

    def _evaluate(self, logger: MetricsLogger, step: int) -> dict:
        self.net.eval()
        with torch.no_grad(), self.autocast():
            metrics = self.evaluate()
        if metrics:
            logger.log(step, metrics, split="val", epoch=self.state["epoch"])
            if self.dist.is_main and not self.cfg.trainer.progress:
                print(f"[laplace] step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        return metrics

    def write_results(self, results: dict):
        """results.json in the run dir (rank 0): what the tables read. The fields every
        trainer shares come first; `results` adds the trainer's own."""
        if self.dist.is_main:
            m = self.cfg.model
            record = {"model": m.name, "num_laplacian_heads": m.num_laplacian_heads,
                      "laplacian_mode": m.laplacian_mode, "dataset": self.cfg.data.name,
                      "seed": self.cfg.seed, "steps": self.state["step"],
                      "epochs": self.state["epoch"], "checkpoint": str(self.ckpt_path), **results}
            path = self.run_dir / "results.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            tmp.replace(path)
