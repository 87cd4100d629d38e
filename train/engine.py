"""The shared training engine: every trainer (deit3, gpt, dino, seg_linear) is a `Trainer`.

The engine owns what is the same for all of them: device and distributed set-up, seeding,
batch arithmetic (global batch = micro batch x world size x accumulation), the optimizers'
schedules, gradient clipping, bf16 autocast and torch.compile, evaluation and checkpoint
cadence, exact resume, preemption and logging. Two phases: construction reads the config
(process group, device, batch arithmetic, no data or model); `setup()` builds, in this order,
data (and feed), model, pre-trained weights (a fresh run), optimizers and schedules, then
restores a checkpoint and wraps the model (DDP, compile). `fit()` sets up first if needed.
The run's length and split: the step plan (train/plan.py); the data: a Feed (train/feeds.py).

A trainer supplies (class attributes, then hooks):
    unit, units_per_sample   what the throughput counts ("img", "tok"), and per sample
    model_archs, data_modality, example    what it trains (checked before anything is built)
                             and a command line that fits, for the error when it does not
    scheduled_values         names in trainer.schedules it reads from self.hparams (the
                             optimizers' own hyper-parameters follow optim.schedules)
    build_datasets()         (train set, val set or None): map-style sets or a Feed   required
    train_step(batch)        (loss, {extra: value}) of one micro-batch                required
    build_model, configure_optimizers, evaluate, data_identity, throughput_metrics, model_metrics,
    before_optimizer_step (clips), after_optimizer_step (e.g. an EMA), export_model (what
    load_model rebuilds), build_sampler, wrap_model, collate, on_fit_end: see each default.
All training state lives in the model and the optimizers (DINO's centre too): a checkpoint
holds those, the data position and each rank's RNG states. Every rank trains rank 0's model (set-up
broadcasts it whole); what is drawn while training (drop-path, Mixup) is each rank's own.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset

from laplace import create_model, dist, model_label
from laplace.attention import gate_metrics
from laplace.checkpoint import (CheckpointError, clean_state_dict, load_pretrained, results_header, rng_state,
                                save_checkpoint, set_rng_state)
from laplace.data.images import report_skipped
from laplace.errors import ConfigError
from laplace.io import write_json

from .feeds import Feed, MapFeed, describe_size, epoch_sampler, split_batch
from .logger import LogWindow, MetricsLogger, format_metrics, print_line, progress_bar
from .plan import step_plan
from .optim import (apply_group_schedules, build_optimizer, build_schedules, check_group_schedules,
                    clip_gradients)
from .resume import check_resumable, find_checkpoint
from .finite import FiniteGuard
from .signals import EXIT_REQUEUE, Preempted, StopRequest, ignore_in_worker


class Trainer:
    """Step-based training loop with exact resume, on `cfg`: the composed config (trainer, model,
    data, optim, logger, paths, seed) with `run_dir` set (train.py derives it from the command line)."""

    unit, units_per_sample = "samples", 1
    model_archs: tuple[str, ...] = ()  # empty: any architecture
    data_modality: str | None = None  # None: any data
    example = ""
    scheduled_values: tuple[str, ...] = ()

    def __init__(self, cfg: DictConfig):
        self.cfg, tc = cfg, cfg.trainer
        self.dist = dist.setup(tc.device)
        self.device = self.dist.device
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_path = self.run_dir / "ckpt" / "last.pt"
        self.amp = (tc.amp == "auto" and self.device.type == "cuda") or tc.amp is True
        self.compile = (tc.compile == "auto" and self.device.type == "cuda") or tc.compile is True
        # Batch arithmetic: the global batch is a property of the recipe, not of the cluster.
        self.micro_bs, self.accum = split_batch(tc.global_batch_size, tc.micro_batch_size, self.dist.world_size)
        if OmegaConf.is_missing(tc, "init_from"):  # a trainer built without train.run's check_required
            raise ConfigError("this experiment fine-tunes a pre-trained model: set trainer.init_from="
                              "PATH (a laplace checkpoint or a timm/DeiT-III state dict)")
        self.is_set_up = False

    @classmethod
    def offline(cls, cfg: DictConfig, device: str = "meta") -> Trainer:
        """Model and optimizers from `cfg` alone on `device` (meta: shapes, no memory), to read what
        a config trains (train/recipe.py): no process group, data, run directory, checkpoint or
        construction checks; one process, no run's main one (hooks print nothing). What it runs
        (build_model, configure_optimizers, export_model, build_sampler) reads no other state."""
        t = cls.__new__(cls)  # __init__ would join the process group and check the run's options
        t.cfg, t.device = cfg, torch.device(device)
        t.dist = SimpleNamespace(rank=0, local_rank=0, world_size=1, device=t.device, is_main=False, distributed=False)
        with t.device:
            t.model = t.build_model()
        t.optimizers = t.configure_optimizers()
        return t

    def setup(self) -> Trainer:
        """Build data, model and optimizers and restore the run's checkpoint (once; returns self)."""
        if self.is_set_up:
            return self
        cfg, tc, world = self.cfg, self.cfg.trainer, self.dist.world_size
        dist.seed_everything(cfg.seed + self.dist.rank)
        # 1. data
        self.train_set, self.val_set = self.build_datasets()
        self.feed = self._feed(self.train_set)
        if self.feed.micro_batches_per_epoch < 1:  # else the loop would wait forever for a batch
            raise ConfigError(f"data={cfg.data.name}: an epoch gives each of the {world} process(es) "
                              f"fewer than one micro batch of {self.micro_bs} ({describe_size(self.train_set)}); "
                              f"lower trainer.global_batch_size={tc.global_batch_size} or use more data")
        self.plan = step_plan(cfg, world, self.feed.micro_batches_per_epoch)
        self.steps_per_epoch, self.total_steps = self.plan.steps_per_epoch, self.plan.total_steps
        self.data_id = self.data_identity()
        # 2. model, and the pre-trained weights of a fresh run (a resumed run restores its own)
        self.model = self.build_model().to(self.device)
        resume = find_checkpoint(self.ckpt_path.parent, self.dist.is_main)
        if tc.init_from and resume is None:
            msg = load_pretrained(self.model, tc.init_from, cfg.model, tc.init_head)
            if self.dist.is_main:
                print(f"[laplace] {msg}")
        # 3. optimizers and schedules
        self.optimizers = self.configure_optimizers()
        self.schedules = build_schedules(cfg.optim.schedules, "optim.schedules", self.total_steps,
                                         self.steps_per_epoch)
        check_group_schedules(self.optimizers, self.schedules)
        self.value_schedules = build_schedules(tc.schedules, "trainer.schedules", self.total_steps,
                                               self.steps_per_epoch)
        missing = set(self.scheduled_values) ^ set(self.value_schedules)
        if missing:
            raise ConfigError(f"trainer.schedules.{sorted(missing)[0]}: trainer={tc.name} reads "
                              f"{sorted(self.scheduled_values) or 'no schedules'}; give exactly those")
        # 4. the checkpoint's state, then the wrappers around the restored model
        self.hparams: dict[str, float] = {}
        self.step = 0
        self.window = LogWindow(self.device)  # reliability: the steps since the last train record (_restore fills it)
        self.resumed = resume is not None
        if resume is not None:
            self._restore(*resume)
        # Rank 0's model is the run's (every rank built its own from its own seed): the whole trained
        # module, not only what DDP wraps and broadcasts (DINO's teacher and centre; main_dino copies
        # the student into the teacher after wrapping it for the same reason).
        dist.broadcast_module_(self.model)
        self.net = self.wrap_model(self.model)
        # Batch norms that no collective keeps equal (gloo has no SyncBatchNorm): averaged each step.
        self.unsynced_stats = dist.unsynced_running_stats(self.model) if self.dist.distributed else []
        self.is_set_up = True
        return self

    # ---- to implement in a trainer -------------------------------------------------------
    def build_datasets(self) -> tuple[Dataset | Feed, Dataset | None]:
        """(training set, validation set or None). The training set is a map-style dataset
        (served by MapFeed) or a Feed itself (laplace.data.shards.TokenStream)."""
        raise NotImplementedError

    def build_model(self) -> nn.Module:
        """The zoo model of the `model` node (or a module holding it, e.g. DINO's student + EMA
        teacher, checkpointed whole as "train_model")."""
        return create_model(**self.cfg.model)

    def configure_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """{name: optimizer}, each with its own parameter groups; default: `optim` over the model."""
        return {self.cfg.optim.name: build_optimizer(self.model, self.cfg.optim)}

    def train_step(self, batch) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch (under autocast) and extra floats to log."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        return {}

    def data_identity(self) -> dict | None:
        """What the training data is (not where: data.root may move), checked on resume
        (train/resume.py). Default: the feed's identity (token shards), if it has one."""
        return (dict(self.feed.identity()) or None) if hasattr(self.feed, "identity") else None  # optional, see Feed

    def throughput_metrics(self, units_per_s: float) -> dict:
        """Extra figures logged beside the throughput (e.g. the GPT's model FLOPs utilisation)."""
        return {}

    def model_metrics(self) -> dict:
        """Figures of the model logged with every train record. Default: the learned gates of the
        exported model (DINO: the teacher backbone), so the last record equals the checkpoint's."""
        return gate_metrics(self.export_model())

    def before_optimizer_step(self) -> dict:
        """After the gradients of a step are complete, before the optimizers step: clips
        them (optim.grad_clip, optim.grad_clip_mode). Returns values to log."""
        o = self.cfg.optim
        norm = clip_gradients(self.optimizers, o.grad_clip, o.grad_clip_mode)
        return {} if norm is None else {"grad_norm": norm}

    def after_optimizer_step(self):
        """After every optimizer stepped (gradients still there): e.g. an EMA update."""

    def export_model(self) -> nn.Module:
        """The network saved as the checkpoint's "model" (what load_model rebuilds from the
        config's `model` node): the trained model unless a trainer says otherwise."""
        return self.model

    def build_sampler(self, dataset: Dataset):
        """The epoch-seeded order of training samples (the DeiT trainer swaps in RepeatAug)."""
        return epoch_sampler(dataset, True, self.cfg.seed, self.dist.rank, self.dist.world_size)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """DDP and torch.compile around the model; optimizers and checkpoints keep the bare one."""
        net = model
        if self.dist.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            # No buffer broadcast before every forward: each is equal on every rank by construction
            # (rotary tables, head masks), by its own all-reduce (DINO's centre, SyncBatchNorm's
            # statistics) or by the engine's average after each step (plain batch norm under gloo).
            net = nn.parallel.DistributedDataParallel(net, device_ids=ids, forward_sync_buffers=False)
        return torch.compile(net) if self.compile else net

    def collate(self, items):
        return torch.utils.data.default_collate(items)

    def on_fit_end(self, final_metrics: dict):
        """Called on every rank once training reached total_steps."""

    # ---- helpers for trainers ------------------------------------------------------------
    def _feed(self, train_set) -> Feed:
        """Micro-batches of the training set (a MapFeed unless the set is a feed already)."""
        if isinstance(train_set, Feed):
            if hasattr(train_set, "set_step_windows"):  # optional (see Feed): epochs end on a step
                train_set.set_step_windows(self.cfg.trainer.global_batch_size)
            return train_set
        return MapFeed(train_set, self.build_sampler(train_set), self.micro_bs, self.cfg.seed,
                       self.dist.rank, self.dist.world_size, step_size=self.cfg.trainer.global_batch_size,
                       **self._loader_kwargs())

    def _loader_kwargs(self) -> dict:
        w = self.cfg.trainer.num_workers
        # An own generator: creating a loader iterator then draws no number from the global
        # RNG, so a resumed run's model randomness (drop-path, mixup) matches an uninterrupted one.
        # The workers leave SIGTERM / SIGUSR1 to this process (train/signals.py).
        return dict(num_workers=w, pin_memory=self.device.type == "cuda", persistent_workers=w > 0,
                    collate_fn=self.collate, generator=torch.Generator().manual_seed(self.cfg.seed),
                    worker_init_fn=ignore_in_worker if w > 0 else None)

    def eval_loader(self, dataset: Dataset, batch_size: int | None = None) -> DataLoader:
        """Each rank gets every world_size-th sample (no padding, so sums over ranks are exact)."""
        shard = torch.utils.data.Subset(dataset, range(self.dist.rank, len(dataset), self.dist.world_size))
        return DataLoader(shard, batch_size=batch_size or self.micro_bs, shuffle=False,
                          **self._loader_kwargs())

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

    @property
    def epoch(self) -> int:
        return self.feed.epoch

    # ---- checkpoints ---------------------------------------------------------------------
    def plain_config(self) -> dict:
        return OmegaConf.to_container(self.cfg, resolve=True)

    def save(self):
        rngs = dist.all_gather_object(rng_state())
        windows = dist.all_gather_object(self.window.state_dict())  # reliability: the record survives a stop
        if self.dist.is_main:
            exported = self.export_model()
            entries = dict(
                optimizer=self.optimizers, rng=rngs,
                loop={"step": self.step, "epoch": self.epoch, "feed": self.feed.state_dict(),
                      "world_size": self.dist.world_size, "log_window": windows})
            if exported is not self.model:
                entries["train_model"] = clean_state_dict(self.model.state_dict())
            if self.data_id:
                entries["data_identity"] = self.data_id
            save_checkpoint(self.ckpt_path, model=exported, config=self.plain_config(), **entries)
            keep = self.cfg.trainer.keep_every
            if keep and self.step % keep == 0:
                save_checkpoint(self.ckpt_path.with_name(f"step_{self.step}.pt"), model=exported,
                                config=self.plain_config(), **entries)
        dist.barrier()

    def _restore(self, path: Path, ckpt: dict):
        check_resumable(path, ckpt, self.plain_config(), self.data_id, self.cfg.data.get("root"),
                        self.cfg.trainer.resume == "force", self.dist.is_main)
        try:
            self.model.load_state_dict(ckpt.get("train_model", ckpt["model"]), strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"{path} does not fit model {model_label(self.cfg.model)}: "
                                  f"{' '.join(str(e).split())[:300]}") from None
        states = ckpt["optimizer"]
        if set(states) != set(self.optimizers):
            raise CheckpointError(f"{path} holds optimizers {sorted(states)} but this run has "
                                  f"{sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            try:
                opt.load_state_dict(states[name])
            except ValueError as e:  # another grouping of the parameters (a forced resume)
                raise CheckpointError(f"{path}: optimizer {name!r} does not fit this run: {e}") from None
        loop = ckpt["loop"]
        self.step = loop["step"]
        self.window.load_state_dict(loop.get("log_window"), self.dist.rank, self.dist.world_size)  # reliability
        try:
            self.feed.load_state_dict(loop["feed"])
        except ValueError as e:  # a forced resume on less data
            raise CheckpointError(f"{path}: its data position does not fit this data ({e})") from None
        if loop.get("world_size") == self.dist.world_size:
            set_rng_state(ckpt["rng"][self.dist.rank])
        else:  # each rank's stream cannot continue on another world size: reseed by step
            dist.seed_everything(self.cfg.seed + self.dist.rank + 7919 * self.step)
        if self.dist.is_main and path.name != "last.pt":
            print(f"[laplace] resumed from {path} (last.pt was missing or unreadable)", file=sys.stderr)

    # ---- the loop ------------------------------------------------------------------------
    def _set_schedules(self, step: int):
        self.hparams = {**apply_group_schedules(self.optimizers, self.schedules, step),
                        **{k: s(step) for k, s in self.value_schedules.items()}}

    def fit(self, stop: StopRequest | None = None) -> dict:
        """Train to total_steps (or trainer.stop_after more steps); returns the last metrics.
        `stop` is the signal flag (train.run installs it before set-up); None: fit's own."""
        with contextlib.nullcontext(stop) if stop is not None else StopRequest() as stop:
            return self.setup()._fit(stop)

    def _fit(self, stop: StopRequest) -> dict:
        cfg, tc = self.cfg, self.cfg.trainer
        main = self.dist.is_main
        wandb_cfg = OmegaConf.to_container(cfg.logger.wandb, resolve=True) if cfg.logger.wandb else None
        logger = MetricsLogger(self.run_dir, enabled=main, wandb_cfg=wandb_cfg, config=self.plain_config(),
                               resume_step=self.step if self.resumed else None)
        if main:
            print(f"[laplace] run_dir={self.run_dir} {'resumed at step ' + str(self.step) if self.resumed else 'new run'}; "
                  f"{self.total_steps} steps ({self.steps_per_epoch}/epoch), global batch "
                  f"{tc.global_batch_size} = {self.micro_bs} x {self.dist.world_size} x {self.accum} accum, "
                  f"device {self.device}, bf16 {self.amp}", flush=True)
        eval_every = tc.eval_every or self.steps_per_epoch
        ckpt_every = tc.ckpt_every or self.steps_per_epoch
        stop_at = min(self.total_steps, self.step + tc.stop_after) if tc.stop_after else self.total_steps
        bar = progress_bar(self.total_steps, interval=cfg.logger.progress_interval,
                           desc="train", initial=self.step, unit="step") if main and tc.progress else None
        batches = iter(self.feed)
        window = self.window  # reliability: the steps since the last record (saved in the checkpoint)
        window.restart_clock()
        metrics = {}
        # A stop is agreed one step after a rank got the signal (StopVote: no per-step wait), and
        # every loss is watched on the device so that no checkpoint step writes a diverged state.
        vote = dist.StopVote()
        guard = FiniteGuard(self.device, self.run_dir, self.step if self.resumed else None)
        while self.step < stop_at:
            self.net.train()
            self._set_schedules(self.step)
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
            extras.update(self.before_optimizer_step() or {})
            for opt in self.optimizers.values():
                opt.step()
            self.after_optimizer_step()
            dist.average_(self.unsynced_stats)
            for opt in self.optimizers.values():
                opt.zero_grad(set_to_none=True)
            self.step = step = self.step + 1
            window.add(loss_sum, self.accum * self.micro_bs * self.dist.world_size * self.units_per_sample)
            guard.update(step, loss_sum)

            # reliability: a stop before total_steps logs nothing; its window waits in the checkpoint
            if step % tc.log_every == 0 or step == self.total_steps:
                dt, seen = window.seconds(), window.units
                # Averaged over ranks (all reach this line at the same step): the logged loss
                # is the global batch's, whatever the world size.
                window_loss = dist.all_reduce_mean(window.loss)
                guard.check(step)
                mean_loss = float(window_loss) / window.steps
                rec = {"loss": mean_loss, **self.hparams, f"{self.unit}_per_s": seen / dt,
                       "step_ms": 1000 * dt / window.steps, "epoch": self.epoch,
                       **self.throughput_metrics(seen / dt), **self.model_metrics(),
                       **{k: float(v) for k, v in extras.items()}}
                logger.log(step, rec, split="train")
                if bar is not None:
                    bar.set_postfix(loss=f"{mean_loss:.4f}", **{f"{self.unit}/s": f"{seen / dt:.0f}"},
                                    refresh=False)  # shown at the next redraw: off a terminal, a line per interval
                window.reset()
            if bar is not None:
                bar.update(1)
            if step % eval_every == 0 or step == self.total_steps:
                metrics = self._evaluate(logger, step)
            saved = step % ckpt_every == 0 or step == stop_at
            if saved:
                guard.check(step, self.model)
                self.save()
            # Every rank stops at the same step, whichever got the signal.
            if vote.poll(stop.signum is not None) and step < stop_at:
                if not saved:
                    guard.check(step, self.model)
                    self.save()
                if main:
                    print(f"[laplace] stop requested (signal): saved step {step}, exiting with "
                          f"status {EXIT_REQUEUE} to be requeued", flush=True)
                logger.finish()
                self._shut_down(vote)
                raise Preempted(step, stop.signum or 0)
        self._shut_down(vote)
        if bar is not None:
            bar.close()
        if self.step >= self.total_steps:
            if not metrics:  # resumed at the very end: evaluate the final weights once more
                metrics = self._evaluate(logger, self.step)
            self.on_fit_end(metrics)
        logger.finish()
        return metrics

    def _shut_down(self, vote: dist.StopVote):
        """End the loop's own processes and collectives, then meet every rank: all leave together,
        after rank 0's last words (wandb included), so that srun --kill-on-bad-exit, seeing the
        first task end, finds the others ending too rather than killing one mid-exit."""
        if hasattr(self.feed, "close"):  # optional, see Feed
            self.feed.close()
        vote.close()
        report_skipped({"train": self.train_set, "val": self.val_set}, self.device, self.dist.is_main)
        dist.barrier()

    def _evaluate(self, logger: MetricsLogger, step: int) -> dict:
        self.net.eval()
        with torch.no_grad(), self.autocast():
            metrics = self.evaluate()
        if metrics:
            logger.log(step, metrics, split="val", epoch=self.epoch)
            if self.dist.is_main:  # one plain line, bar or not (tqdm.write keeps the bar whole)
                print_line(format_metrics(step, metrics))
        return metrics

    def write_results(self, results: dict):
        """results.json in the run dir (rank 0): what the tables read. The fields every
        trainer shares come first; `results` adds the trainer's own."""
        if self.dist.is_main:
            m = self.plain_config()["model"]  # plain: a per-layer list is a list, not a ListConfig
            record = results_header(m, self.cfg.data.name, self.ckpt_path, seed=self.cfg.seed, steps=self.step,
                                    epochs=self.epoch, **results)
            write_json(self.run_dir / "results.json", record)

