"""The shared training engine: every trainer (deit3, gpt, dino, seg_linear) is a `Trainer`.

A trainer is six methods, all it may override (the loop, its devices, DDP, accumulation,
schedules, clipping, bf16, compile, cadences, resume, preemption, logging and results.json are
the engine's):

    build_data()            -> laplace.data.Data: training set (or feed), validation set,
                               collate, units, identity                               required
    build_model()           -> the module trained (default: the zoo model of `model`)
    configure_optimizers()  -> {name: optimizer} (default: train.optim.build_optimizers)
    train_step(batch)       -> loss, or (loss, {extra: value}) of one micro-batch      required
    evaluate()              -> {metric: value} (default: none)
    results(metrics)        -> the trainer's own fields of results.json (default: none)

and declares, as class attributes: `archs` / `modality` / `example` (what it trains, checked
before anything is built), `export` (the submodule a checkpoint's "model" holds, "" the whole:
DINO "teacher.backbone"), `scheduled_values` (names it reads from `self.hparams`, given under
trainer.schedules) and `best_metric` (results.json's "best" record). What happens around an
optimizer's step (DINO's EMA teacher) is torch's optimizer hooks, registered by the trainer.
Names: `self.model` is the module trained, `self.net` the same wrapped (DDP, compile),
`self.exported` what a checkpoint's "model" holds (what `load_model` rebuilds).
All training state lives in the model and the optimizers: a checkpoint holds those, the data
position, the logging window and each rank's RNG states. Every rank trains rank 0's model (DDP's
construction broadcasts it whole); what is drawn while training (drop-path, Mixup) is each rank's own.
"""
import contextlib
import sys
from collections.abc import Sized
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from timm.models import clean_state_dict  # strips DDP's `module.` and torch.compile's `_orig_mod.`
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from laplace import create_model, model_label
from laplace.attention import gate_metrics
from laplace.checkpoint import CheckpointError, save_checkpoint
from laplace.data import Data
from laplace.errors import ConfigError
from laplace.io import write_json
from laplace.pretrained import load_pretrained

from . import dist
from .feeds import Feed, MapFeed, split_batch, train_sampler
from .logger import LogWindow, MetricsLogger, format_metrics, git_commit, logged, progress_bar
from .plan import resolve_batch, step_plan
from .optim import apply_group_schedules, build_optimizers, build_schedules, check_group_schedules, clip_gradients
from .rundir import results_header
from .resume import check_resumable, find_checkpoint, rng_state, set_rng_state
from .finite import FiniteGuard
from .signals import EXIT_REQUEUE, Preempted, StopRequest, ignore_in_worker

# bf16 dense peak of one GPU, for the model FLOPs utilisation of trainers that count FLOPs
# (trainer.peak_flops overrides; none on CPU).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12,
                   "A100": 312e12, "A800": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12}


class Trainer:
    """Step-based training loop with exact resume, on `cfg`: the composed config (trainer, model,
    data, optim, logger, paths, seed) with `run_dir` set (train.py derives it from the command line)."""

    archs: tuple[str, ...] = ()  # what it trains ("vit", "gpt"); empty: any architecture
    modality: str | None = None  # the data it reads (data.modality); None: any
    example = ""  # a command line that fits, for the error when a combination does not
    export = ""  # the submodule a checkpoint's "model" holds ("": the module trained)
    scheduled_values: tuple[str, ...] = ()  # names under trainer.schedules, read from self.hparams
    best_metric: str | None = None  # results.json's "best": the evaluation with the highest one
    flops_per_unit: float | None = None  # set by a trainer that counts FLOPs: the MFU is logged

    def __init__(self, cfg: DictConfig):
        self.cfg, tc = resolve_batch(cfg), cfg.trainer  # optim=muon26 without a batch: nanochat's rule sets it
        self.dist = dist.setup(tc.device)
        self.device = self.dist.device
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_path = self.run_dir / "ckpt" / "last.pt"
        self.amp = (tc.amp == "auto" and self.device.type == "cuda") or tc.amp is True
        self.compile = (tc.compile == "auto" and self.device.type == "cuda") or tc.compile is True
        self.peak_flops = tc.get("peak_flops") or (next(
            (v for k, v in PEAK_BF16_FLOPS.items() if k in torch.cuda.get_device_name(self.device)), None)
            if self.device.type == "cuda" else None)
        # The split of the global batch (a property of the recipe, not of the cluster); the run's
        # length follows once the data's size is known (setup).
        self.micro_bs, self.accum = split_batch(tc.global_batch_size, tc.micro_batch_size, self.dist.world_size)

    @classmethod
    def offline(cls, cfg: DictConfig, device: str = "meta") -> "Trainer":
        """Model and optimizers from `cfg` alone on `device` (meta: shapes, no memory), to read what
        a config trains (train/recipe.py): no process group, data, run directory, checkpoint or
        construction checks; one process, not the run's main one (nothing printed)."""
        t = cls.__new__(cls)  # __init__ would join the process group and check the run's options
        t.cfg, t.device = cfg, torch.device(device)
        t.dist = SimpleNamespace(rank=0, local_rank=0, world_size=1, device=t.device, is_main=False, distributed=False)
        with t.device:
            t.model = t.build_model()
        t.optimizers = t.configure_optimizers()
        return t

    def setup(self) -> "Trainer":
        """Build data, model and optimizers and restore the run's checkpoint (returns self)."""
        cfg, tc, world = self.cfg, self.cfg.trainer, self.dist.world_size
        dist.seed_everything(cfg.seed + self.dist.rank)
        # 1. data: a feed of micro-batches (a map-style set is served by a MapFeed), the run's length
        self.data = self.build_data()
        self.feed = self.data.train if isinstance(self.data.train, Feed) else MapFeed(
            self.data.train, self.sampler(self.data.train), self.micro_bs, cfg.seed, self.dist.rank, world,
            step_size=tc.global_batch_size, **self._loader_kwargs(self.data.collate))
        if self.feed.micro_batches_per_epoch < 1:  # else the loop would wait forever for a batch
            n = len(self.data.train) if isinstance(self.data.train, Sized) else None
            size = "a streamed training set" if n is None else f"the training set has {n} samples"
            raise ConfigError(f"data={cfg.data.name}: an epoch gives each of the {world} process(es) "
                              f"fewer than one micro batch of {self.micro_bs} ({size}); "
                              f"lower trainer.global_batch_size={tc.global_batch_size} or use more data")
        self.plan = step_plan(cfg, world, self.feed.micro_batches_per_epoch)
        self.steps_per_epoch, self.total_steps = self.plan.steps_per_epoch, self.plan.total_steps
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
        if missing := set(self.scheduled_values) ^ set(self.value_schedules):
            raise ConfigError(f"trainer.schedules.{sorted(missing)[0]}: trainer={tc.name} reads "
                              f"{sorted(self.scheduled_values) or 'no schedules'}; give exactly those")
        # 4. the checkpoint's state, then the wrappers around the restored model
        self.hparams: dict[str, float] = {}
        self.step = 0
        self.window = LogWindow(self.device)  # the steps since the last train record (_restore fills it)
        self.resumed = resume is not None
        self.started_commit = git_commit() if self.dist.is_main else None  # the run's code (_restore: saved)
        if resume is not None:
            self._restore(*resume)
        self.net = self._wrap(self.model)
        # Batch norms that no collective keeps equal (gloo has no SyncBatchNorm): averaged each step.
        self.unsynced_stats = dist.unsynced_running_stats(self.model) if self.dist.distributed else []
        return self

    # ---- the contract: what a trainer overrides (see the module docstring) ------------------
    def build_data(self) -> Data:
        """The run's data: `Data(train, val, collate, unit, units_per_sample, identity)`."""
        raise NotImplementedError

    def build_model(self) -> nn.Module:
        """The module trained: by default the zoo model of the `model` node."""
        return create_model(**self.cfg.model)

    def configure_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """{name: optimizer}: by default the `optim` family's (AdamW, LAMB, Muon + AdamW) over the model."""
        return build_optimizers(self.model, self.cfg.optim)

    def train_step(self, batch) -> torch.Tensor | tuple[torch.Tensor, dict]:
        """The loss of one micro-batch (under autocast), and optionally extra values to log."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        """Validation metrics ("val_*"), on every rank (sums all-reduced); {}: none."""
        return {}

    def results(self, metrics: dict) -> dict:
        """The trainer's own fields of results.json, beside the engine's (header, final, best)."""
        return {}

    # ---- what trainers use -----------------------------------------------------------------
    @property
    def exported(self) -> nn.Module:
        """The network a checkpoint's "model" holds, what load_model rebuilds (`export`)."""
        return self.model.get_submodule(self.export)

    def eval_loader(self, dataset: Dataset, batch_size: int | None = None) -> DataLoader:
        """Each rank gets every world_size-th sample (no padding, so sums over ranks are exact)."""
        shard = torch.utils.data.Subset(dataset, range(self.dist.rank, len(dataset), self.dist.world_size))
        return DataLoader(shard, batch_size=batch_size or self.micro_bs, shuffle=False,
                          **self._loader_kwargs(self.data.val_collate or self.data.collate))

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp)

    def to_device(self, batch):
        # tensors anywhere in a batch (lists, tuples, dicts of them: multi-crop, decoded images)
        return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(self.device, non_blocking=True), batch)

    # ---- the engine's own ------------------------------------------------------------------
    def sampler(self, dataset):
        """The epoch's order of the training samples: shuffled by (seed, epoch), or timm's repeated
        augmentation with trainer.repeated_aug > 1 (DeiT-III); the recipe cards count with it too."""
        return train_sampler(dataset, self.cfg.seed, self.dist.rank, self.dist.world_size,
                             self.cfg.trainer.get("repeated_aug"))

    def _loader_kwargs(self, collate) -> dict:
        w = self.cfg.trainer.num_workers
        # An own generator: creating a loader iterator then draws no number from the global
        # RNG, so a resumed run's model randomness (drop-path, mixup) matches an uninterrupted one.
        # The workers leave SIGTERM / SIGUSR1 to this process (train/signals.py).
        return dict(num_workers=w, pin_memory=self.device.type == "cuda", persistent_workers=w > 0,
                    collate_fn=collate, generator=torch.Generator().manual_seed(self.cfg.seed),
                    worker_init_fn=ignore_in_worker if w > 0 else None)

    def _wrap(self, model: nn.Module) -> nn.Module:
        """DDP and torch.compile around the model; optimizers and checkpoints keep the bare one."""
        net = model
        if self.dist.distributed:
            if self.device.type == "cuda":  # batch statistics over the global batch (timm's --sync-bn,
                # DINO's head, DINOv2's segmentation head); SyncBatchNorm has CUDA kernels only
                net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
            ids = [self.device.index] if self.device.type == "cuda" else None
            # Rank 0's model is the run's (every rank built its own from its own seed): constructing
            # DDP broadcasts rank 0's parameters and buffers, of the whole trained module (DINO's
            # teacher and centre: frozen weights and buffers), forward_sync_buffers=False included.
            # No buffer broadcast before every forward: each is equal on every rank by construction
            # (rotary tables, head masks), by its own all-reduce (DINO's centre, SyncBatchNorm's
            # statistics) or by the engine's average after each step (plain batch norm under gloo).
            net = nn.parallel.DistributedDataParallel(net, device_ids=ids, forward_sync_buffers=False)
        return torch.compile(net) if self.compile else net

    # ---- checkpoints ---------------------------------------------------------------------
    def plain_config(self) -> dict:
        return OmegaConf.to_container(self.cfg, resolve=True)

    def save(self):
        rngs = dist.all_gather_object(rng_state())
        windows = dist.all_gather_object(self.window.state_dict())  # the record survives a stop
        if self.dist.is_main:
            exported = self.exported
            entries = dict(
                optimizer={name: opt.state_dict() for name, opt in self.optimizers.items()}, rng=rngs,
                # total_steps: an export of a run stopped early says so (laplace.export)
                loop={"step": self.step, "total_steps": self.total_steps, "epoch": self.feed.epoch, "feed": self.feed.state_dict(),
                      "world_size": self.dist.world_size, "log_window": windows, "commit": self.started_commit})
            if exported is not self.model:  # the module trained, whole, for resume
                entries["train_model"] = clean_state_dict(self.model.state_dict())
            if self.data.identity:
                entries["data_identity"] = self.data.identity
            keep = self.cfg.trainer.keep_every
            kept = [self.ckpt_path.with_name(f"step_{self.step}.pt")] if keep and self.step % keep == 0 else []
            for path in (self.ckpt_path, *kept):
                save_checkpoint(path, model=exported, config=self.plain_config(), **entries)
        dist.barrier()

    def _restore(self, path: Path, ckpt: dict):
        check_resumable(path, ckpt, self.plain_config(), self.data.identity, self.cfg.data.get("root"),
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
        self.step, self.started_commit = loop["step"], loop.get("commit")  # (no commit before 2026-12-06)
        self.window.load_state_dict(loop.get("log_window"), self.dist.rank, self.dist.world_size)
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
        """After setup(): train to total_steps (or trainer.stop_after more steps); returns the last
        metrics. `stop`: the signal flag train.run installs before set-up (None: fit's own)."""
        if stop is None:
            with StopRequest() as stop:
                return self.fit(stop)
        cfg, tc, optim = self.cfg, self.cfg.trainer, self.cfg.optim
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
        # another rank, or progress=false: a bar that shows nothing (its calls are no-ops)
        bar = progress_bar(self.total_steps, main and tc.progress, interval=cfg.logger.progress_interval,
                           desc="train", initial=self.step, unit="step")
        batches = iter(self.feed)
        window = self.window  # the steps since the last record (saved in the checkpoint)
        window.restart_clock()
        units_per_step = tc.global_batch_size * self.data.units_per_sample
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
                    out = self.train_step(batch)
                loss, extra = out if isinstance(out, tuple) else (out, {})
                (loss / self.accum).backward()
                loss_sum += loss.detach().float() / self.accum
                for k, v in extra.items():
                    extras[k] = extras.get(k, 0.0) + v / self.accum
            grad_norm = clip_gradients(self.optimizers, optim.grad_clip, optim.grad_clip_mode)
            if grad_norm is not None:
                extras["grad_norm"] = grad_norm
            for opt in self.optimizers.values():  # their hooks run around each step (DINO's EMA teacher)
                opt.step()
            dist.average_(self.unsynced_stats)
            for opt in self.optimizers.values():
                opt.zero_grad(set_to_none=True)
            self.step = step = self.step + 1
            window.add(loss_sum, units_per_step)
            guard.update(step, loss_sum)

            # A stop before total_steps logs nothing: its window waits in the checkpoint.
            if step % tc.log_every == 0 or step == self.total_steps:
                dt, seen = window.seconds(), window.units
                # Averaged over ranks (all reach this line at the same step): the logged loss
                # is the global batch's, whatever the world size.
                window_loss = dist.all_reduce_sum(window.loss) / self.dist.world_size
                guard.check(step)
                mean_loss = float(window_loss) / window.steps
                # the exported model's learned gates: the last record equals the checkpoint's
                rec = {"loss": mean_loss, **self.hparams, f"{self.data.unit}_per_s": seen / dt}
                if self.flops_per_unit and self.peak_flops:  # the model FLOPs utilisation
                    rec["mfu"] = seen / dt * self.flops_per_unit / (self.peak_flops * self.dist.world_size)
                rec.update(step_ms=1000 * dt / window.steps, epoch=self.feed.epoch, **gate_metrics(self.exported),
                           **{k: float(v) for k, v in extras.items()})
                logger.log(step, rec, split="train")
                bar.set_postfix(loss=f"{mean_loss:.4f}", **{f"{self.data.unit}/s": f"{seen / dt:.0f}"},
                                refresh=False)  # shown at the next redraw: off a terminal, a line per interval
                window.reset()
            bar.update(1)
            if step % eval_every == 0 or step == self.total_steps:
                metrics = self._evaluate(logger, step)
            # Every rank stops at the same step, whichever got the signal.
            preempted = vote.poll(stop.signum is not None) and step < stop_at
            if preempted or step % ckpt_every == 0 or step == stop_at:
                guard.check(step, self.model)
                self.save()
            if preempted:
                if main:
                    print(f"[laplace] stop requested (signal): saved step {step}, exiting with "
                          f"status {EXIT_REQUEUE} to be requeued", flush=True)
                logger.finish()
                self._shut_down(vote)
                raise Preempted(step, stop.signum or 0)
        self._shut_down(vote)
        bar.close()
        if self.step >= self.total_steps:
            if not metrics:  # resumed at the very end: evaluate the final weights once more
                metrics = self._evaluate(logger, self.step)
            self._write_results(metrics)
        logger.finish()
        return metrics

    def _shut_down(self, vote: dist.StopVote):
        """End the loop's own processes and collectives, then meet every rank: all leave together,
        after rank 0's last words (wandb included), so that srun --kill-on-bad-exit, seeing the
        first task end, finds the others ending too rather than killing one mid-exit."""
        self.feed.close()
        vote.close()
        from laplace.data.images import report_skipped  # (image sets only; a lazy import keeps text runs off it)

        report_skipped({"train": self.data.train, "val": self.data.val}, self.device, self.dist.is_main)
        dist.barrier()

    def _evaluate(self, logger: MetricsLogger, step: int) -> dict:
        self.net.eval()
        with torch.no_grad(), self.autocast():
            metrics = self.evaluate()
        if metrics:
            logger.log(step, metrics, split="val", epoch=self.feed.epoch)
            if self.dist.is_main:  # one plain line, bar or not: on a terminal tqdm.write clears an open
                # bar, prints and redraws it; off a terminal the bars write to train.logger._Lines, which
                # tqdm.write leaves alone (a redraw would only add a line)
                tqdm.write(format_metrics(step, metrics), file=sys.stdout)
                sys.stdout.flush()
        return metrics

    def _write_results(self, metrics: dict):
        """results.json in the run dir, what the tables read: the header every results.json
        opens with, the final evaluation (without one, the last training loss), the best one by
        `best_metric` over this run's records, and the trainer's own fields."""
        own = self.results(metrics)  # on every rank: a trainer's results may hold collectives' outputs
        if not self.dist.is_main:
            return
        tc, d = self.cfg.trainer, self.cfg.data
        final = metrics or {"train_loss": next((r["loss"] for r in reversed(logged(self.run_dir, "train"))), None)}
        resumes = [{k: r.get(k) for k in ("step", "commit")} for r in logged(self.run_dir, "resume")]  # each stop
        record = results_header(self.plain_config()["model"], d.name, self.ckpt_path, seed=self.cfg.seed,
                                steps=self.step, epochs=self.feed.epoch, global_batch_size=tc.global_batch_size,
                                init_from=tc.init_from, final=final, commit=self.started_commit, resumes=resumes)
        if d.get("img_size"):
            record.update(img_size=d.img_size, patch_size=d.get("patch_size"))
        if self.best_metric and metrics:
            best = max([metrics, *logged(self.run_dir, "val")], key=lambda r: r.get(self.best_metric, float("-inf")))
            record["best"] = {k: best[k] for k in metrics} | {"step": best.get("step", self.step)}
        write_json(self.run_dir / "results.json", {**record, **own})
