"""The engine's contract for every trainer: several optimizers, schedules of any
hyper-parameter or trainer value, hooks around the optimizer step, state kept in the model, an
exported network, streaming data, and exact resume of all of it (toy trainers in toy_trainers.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from omegaconf import open_dict

import toy_trainers
from conftest import TINY_VIT, schedule_node
from laplace.checkpoint import CheckpointError, load_checkpoint, load_model
from laplace.data.shards import write_shard
from laplace.errors import ConfigError
from train import run
from train.feeds import Feed, MapFeed, train_sampler
from train.logger import read_metrics
from train.optim import (Schedule, apply_group_schedules, build_schedules, check_group_schedules,
                         clip_gradients, parse_length)
from train.feeds import SeededRepeatAugSampler
from train.deit3 import DeiT3Trainer


def _train(run_dir, key="loss"):
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if r.get("split") == "train"]


# ---------------------------------------------------------------- schedules


def test_schedules_reproduce_the_recipes():
    # DeiT-III: linear warm-up from 1e-6 over 5 steps, cosine to 1e-5 at the last step.
    deit = Schedule(value=3e-3, total_steps=100, warmup=5, start=1e-6, shape="cosine", end=1e-5)
    for step in (0, 3, 5, 40, 99, 100):
        want = (1e-6 + (3e-3 - 1e-6) * step / 5 if step < 5 else
                1e-5 + 0.5 * (3e-3 - 1e-5) * (1 + math.cos(math.pi * (step - 5) / 95)))
        assert deit(step) == pytest.approx(want, rel=1e-12)
    # nanochat: a 1.0 multiplier held, then linear to 0 over the last 20%.
    nano = Schedule.from_config(schedule_node(1.0, warmdown="20%", shape="linear", end=0.0),
                                "optim.schedules.lr", 100, 10)
    assert [nano(s) for s in (0, 79, 80, 90, 100)] == pytest.approx([1, 1, 1, 0.5, 0])
    # nanochat's Muon momentum: 0.85 -> 0.95 over 300 steps, then flat.
    mom = Schedule.from_config(schedule_node(0.95, warmup=300, start=0.85), "m", 1000, 10)
    assert [mom(s) for s in (0, 150, 300, 999)] == pytest.approx([0.85, 0.90, 0.95, 0.95])
    # DINO: weight decay cosine 0.04 -> 0.4; teacher temperature 0.04 -> 0.07 over 3 epochs.
    wd = Schedule.from_config(schedule_node(0.04, shape="cosine", end=0.4), "wd", 100, 10)
    assert [wd(s) for s in (0, 50, 100)] == pytest.approx([0.04, 0.22, 0.4])
    temp = Schedule.from_config(schedule_node(0.07, warmup="3ep", start=0.04), "t", 100, 10)
    assert [temp(s) for s in (0, 15, 30, 99)] == pytest.approx([0.04, 0.055, 0.07, 0.07])


def test_schedule_lengths_and_errors():
    assert parse_length(300, "k", 10, 1000) == 300
    assert parse_length("5ep", "k", 10, 1000) == 50
    assert parse_length("20%", "k", 10, 1000) == 200
    assert parse_length("0.5ep", "k", 10, 1000) == 5
    for node, match in [(schedule_node(1, warmup="5 epochs", start=0), r"optim.schedules.lr.warmup='5 epochs'"),
                        (schedule_node(1, shape="step"), r"optim.schedules.lr.shape='step'"),
                        (schedule_node(None, warmup=3), r"optim.schedules.lr.value is required"),
                        ({**schedule_node(1), "min": 0}, r"optim.schedules.lr.min: unknown schedule key")]:
        with pytest.raises(ConfigError, match=match):
            build_schedules({"lr": node}, "optim.schedules", 100, 10)


def test_group_schedules_honour_scales_and_skip_absent_keys():
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    opts = {"adamw": torch.optim.AdamW([{"params": [a]}, {"params": [b], "weight_decay": 0.0},
                                        {"params": [c], "lr_scale": 0.1}], lr=1.0, weight_decay=0.5),
            "sgd": torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0, momentum=0.5)}
    sched = build_schedules({"lr": schedule_node(2.0), "weight_decay": schedule_node(0.3),
                             "momentum": schedule_node(0.9)}, "optim.schedules", 10, 1)
    check_group_schedules(opts, sched)
    assert apply_group_schedules(opts, sched, 0) == {"lr": 2.0, "weight_decay": 0.3, "momentum": 0.9}
    g = opts["adamw"].param_groups
    assert [x["lr"] for x in g] == pytest.approx([2.0, 2.0, 0.2])  # lr_scale kept
    assert [x["weight_decay"] for x in g] == [0.3, 0.0, 0.3]  # the no-decay group stays at 0
    assert opts["sgd"].param_groups[0]["momentum"] == 0.9 and "momentum" not in g[0]
    with pytest.raises(ConfigError, match="optim.schedules.mommentum: no parameter group"):
        check_group_schedules(opts, build_schedules({"mommentum": schedule_node(0.9)}, "optim.schedules", 10, 1))


@pytest.mark.cuda
def test_clip_gradients_modes(device):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, device=device)) for _ in range(3)]
    grads = [torch.randn(5, device=device) * s for s in (1.0, 10.0, 0.1)]

    def fresh(mode, limit=1.0):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opts = {"o": torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "grad_clip": 0.01}], lr=1)}
        return clip_gradients(opts, limit, mode), [p.grad.clone() for p in params]

    total = torch.cat(grads).norm()
    norm, got = fresh("global")
    torch.testing.assert_close(norm, total)
    for g, w in zip(got, grads):
        torch.testing.assert_close(g, w * (1.0 / (total + 1e-6)))
    norm, got = fresh("param")  # DINO: each tensor clipped on its own (the 2nd group at its limit)
    torch.testing.assert_close(norm, total)
    for g, w, limit in zip(got, grads, (1.0, 1.0, 0.01)):
        torch.testing.assert_close(g, w * min(1.0, limit / (w.norm().item() + 1e-6)))
    _, got = fresh("group")  # the second group has its own limit
    first = torch.cat(grads[:2]).norm()
    torch.testing.assert_close(got[0], grads[0] / (first + 1e-6))
    torch.testing.assert_close(got[2].norm(), torch.tensor(0.01, device=device), rtol=1e-4, atol=0)
    with pytest.raises(ConfigError, match="grad_clip_mode"):
        fresh("layer")


# ---------------------------------------------------------------- a DINO-like toy trainer

EMA_TOY = [*TINY_VIT, "model=vitt_1L", "trainer.name=toy_trainers:EMAToy", "trainer.max_steps=6",
           "trainer.eval_every=100", "trainer.ckpt_every=100", "optim.lr=1e-2",
           "model.drop_path_rate=0.1", "data.augment=three_augment"]


def _ema_cfg(make_cfg, *extra, run_dir):
    cfg = make_cfg(*EMA_TOY, *extra, run_dir=run_dir)
    with open_dict(cfg):
        cfg.optim.schedules.weight_decay = schedule_node(0.05, shape="cosine", end=0.2)
        cfg.optim.schedules.momentum = schedule_node(0.9, warmup=3, start=0.5)
        cfg.trainer.schedules = {"ema_momentum": schedule_node(0.9, shape="linear", end=0.99)}
    return cfg


def test_toy_trainer_with_two_optimizers_and_an_ema_teacher_resumes_exactly(make_cfg, tmp_path):
    run(_ema_cfg(make_cfg, run_dir=tmp_path / "straight"))
    run(_ema_cfg(make_cfg, "trainer.stop_after=3", run_dir=tmp_path / "resumed"))
    mid = load_checkpoint(tmp_path / "resumed/ckpt/last.pt")
    assert mid["loop"]["step"] == 3 and set(mid["optimizer"]) == {"adamw", "sgd"}
    run(_ema_cfg(make_cfg, run_dir=tmp_path / "resumed"))

    a, b = tmp_path / "straight", tmp_path / "resumed"
    assert _train(a) == _train(b) and len(_train(a)) == 6
    assert _train(a, "noise") == _train(b, "noise")  # each rank's random stream continued
    ca, cb = load_checkpoint(a / "ckpt/last.pt"), load_checkpoint(b / "ckpt/last.pt")
    for key in ("model", "train_model"):  # teacher (exported) and student + teacher
        assert ca[key].keys() == cb[key].keys() and all(torch.equal(ca[key][k], cb[key][k]) for k in ca[key])
    assert torch.equal(ca["train_model"]["center"], cb["train_model"]["center"])  # state of the model
    assert ca["optimizer"]["sgd"]["state"].keys() == cb["optimizer"]["sgd"]["state"].keys()

    # Schedules: logged values and the groups' hyper-parameters follow them.
    rec = [r for r in read_metrics(a) if r.get("split") == "train"]
    wd = Schedule(value=0.05, total_steps=6, shape="cosine", end=0.2)
    assert [r["weight_decay"] for r in rec] == pytest.approx([wd(s) for s in range(6)])
    assert [r["momentum"] for r in rec][:4] == pytest.approx([0.5, 0.6333333, 0.7666667, 0.9])
    assert [r["ema_momentum"] for r in rec] == pytest.approx([0.9 + 0.09 * s / 6 for s in range(6)])
    groups = ca["optimizer"]["adamw"]["param_groups"]
    assert groups[0]["weight_decay"] == pytest.approx(wd(5)) and groups[1]["weight_decay"] == 0.0
    assert ca["optimizer"]["sgd"]["param_groups"][0]["momentum"] == pytest.approx(0.9)

    # The exported model is the teacher, rebuilt by load_model; it is not the student.
    teacher = load_model(a / "ckpt/last.pt")
    student = {k[len("student."):]: v for k, v in ca["train_model"].items() if k.startswith("student.")}
    assert all(torch.equal(teacher.state_dict()[k], ca["train_model"][f"teacher.{k}"]) for k in student)
    assert not torch.equal(student["blocks.0.attn.qkv.weight"], teacher.state_dict()["blocks.0.attn.qkv.weight"])


def test_before_step_hook_freezes_the_head(make_cfg, tmp_path):
    """The head gets no update in the first FREEZE_STEPS steps (DINO's frozen last layer)."""
    cfg = _ema_cfg(make_cfg, f"trainer.max_steps={toy_trainers.FREEZE_STEPS}", run_dir=tmp_path / "r")
    init = toy_trainers.EMAToy(cfg).setup().model.state_dict()  # the same seed builds the same weights
    run(cfg)
    got = load_checkpoint(tmp_path / "r/ckpt/last.pt")["train_model"]
    assert torch.equal(got["student.head.weight"], init["student.head.weight"])
    assert not torch.equal(got["student.blocks.0.mlp.fc1.weight"], init["student.blocks.0.mlp.fc1.weight"])


def test_trainer_schedules_must_match_what_the_trainer_reads(make_cfg, tmp_path):
    cfg = _ema_cfg(make_cfg, run_dir=tmp_path / "r")
    with open_dict(cfg):
        cfg.trainer.schedules = {"ema_momentm": schedule_node(0.9)}
    with pytest.raises(ConfigError, match="trainer.schedules.ema_mom"):
        run(cfg)


# ---------------------------------------------------------------- streaming token data


def write_token_shards(root, n_shards=3, tokens=3000, vocab=257, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(n_shards):
        write_shard(root / "train" / f"shard_{i:05d}.npy", rng.integers(0, vocab, tokens), vocab)
    return root


STREAM = ["trainer.name=toy_trainers:StreamLM", "trainer=gpt", "data=pydoc_text", "model=gpt_d2_1L",
          "data.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
          "trainer.num_workers=0", "trainer.progress=false", "trainer.log_every=1",
          "trainer.eval_every=100", "trainer.ckpt_every=100", "trainer.max_steps=6"]


def test_streaming_feed_resumes_at_the_same_token(make_cfg, tmp_path):
    root = write_token_shards(tmp_path / "shards")
    common = [*STREAM, f"+data.root={root}"]
    run(make_cfg(*common, run_dir=tmp_path / "straight"))
    run(make_cfg(*common, "trainer.stop_after=3", run_dir=tmp_path / "resumed"))
    # 3 steps x 8 windows, and the position is global (world-size independent).
    assert load_checkpoint(tmp_path / "resumed/ckpt/last.pt")["loop"]["feed"] == {"epoch": 0, "position": 24}
    run(make_cfg(*common, run_dir=tmp_path / "resumed"))
    a, b = tmp_path / "straight", tmp_path / "resumed"
    assert _train(a, "first_token") == _train(b, "first_token") and _train(a) == _train(b)
    # The first token of step s's first window is token 32 * 8 * s of the stream.
    stream = np.concatenate([np.load(root / "train" / f"shard_{i:05d}.npy") for i in range(3)])
    # first_token is averaged over the 2 micro-batches: windows 8s and 8s + 4.
    want = [(float(stream[32 * 8 * s]) + float(stream[32 * (8 * s + 4)])) / 2 for s in range(6)]
    assert [v for _, v in _train(a, "first_token")] == pytest.approx(want)


def test_stream_resumes_across_an_epoch_end_with_another_micro_batch(make_cfg, tmp_path):
    """93 windows, steps of 8: 11 steps an epoch. Killed at step 10 with micro batch 4, resumed
    with micro batch 8: steps 11-14 (across the epoch end) see the windows of the straight run.
    Before, micro batch 4 took half a step from the epoch's remainder (windows 88-91), micro
    batch 8 none, and every step after the epoch end differed."""
    root = write_token_shards(tmp_path / "shards", tokens=1000)
    common = [*STREAM, f"+data.root={root}", "trainer.max_steps=14"]
    run(make_cfg(*common, run_dir=tmp_path / "straight"))
    run(make_cfg(*common, "trainer.stop_after=10", run_dir=tmp_path / "resumed"))
    run(make_cfg(*common, "trainer.micro_batch_size=8", run_dir=tmp_path / "resumed"))
    a, b = _train(tmp_path / "straight"), _train(tmp_path / "resumed")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 15))
    # Equal up to the order of the sums (one micro-batch of 8 vs two of 4).
    assert [v for _, v in b] == pytest.approx([v for _, v in a], rel=1e-5, abs=1e-6)
    assert load_checkpoint(tmp_path / "resumed/ckpt/last.pt")["loop"]["feed"] == {"epoch": 1, "position": 24}


def test_resume_on_other_shards_is_refused_and_moved_shards_resume(make_cfg, tmp_path):
    root = write_token_shards(tmp_path / "shards")
    common = [*STREAM, "trainer.stop_after=3"]
    run(make_cfg(*common, f"+data.root={root}", run_dir=tmp_path / "run"))
    other = write_token_shards(tmp_path / "other", n_shards=2, seed=1)
    with pytest.raises(CheckpointError) as e:
        run(make_cfg(*common, f"+data.root={other}", run_dir=tmp_path / "run"))
    msg = str(e.value)
    assert "\n" not in msg and f"data.root={other}" in msg and "shards 3 -> 2" in msg
    assert "trainer.resume=force" in msg
    # The same shards on another path (another machine): resumed.
    moved = tmp_path / "moved"
    root.rename(moved)
    run(make_cfg(*common, f"+data.root={moved}", run_dir=tmp_path / "run"))
    assert load_checkpoint(tmp_path / "run/ckpt/last.pt")["loop"]["step"] == 6


# ---------------------------------------------------------------- map-style feeds across world sizes


class _Draws(torch.utils.data.Dataset):
    """Item i is (i, a number drawn from torch's RNG): what the augmentation of i would see."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return i, int(torch.randint(0, 2**30, ()))


@pytest.mark.parametrize("sampler", ["distributed", "repeat_aug"])
def test_map_feed_resumes_on_another_world_size(sampler):
    def feed(rank, world, micro):
        s = (train_sampler(_Draws(), 3, rank, world) if sampler == "distributed"
             else SeededRepeatAugSampler(_Draws(), world, rank, 3, seed=3))
        return MapFeed(_Draws(), s, micro, seed=3, rank=rank, world_size=world, num_workers=0)

    def rows(batch):
        return list(zip(batch[0].tolist(), batch[1].tolist()))

    one = iter(feed(0, 1, 4))
    straight = [rows(next(one)) for _ in range(3)]  # 12 samples, then continue
    f = feed(0, 1, 4)
    it = iter(f)
    for _ in range(2):
        next(it)
    state = f.state_dict()
    assert state == {"epoch": 0, "position": 8}
    two = [feed(r, 2, 2) for r in (0, 1)]
    for t in two:
        t.load_state_dict(state)
    nxt = [next(iter(t)) for t in two]
    # Ranks 0 and 1 take global positions 8, 10 and 9, 11: together, one rank's next batch,
    # the same samples with the same augmentation draws.
    assert sorted(rows(nxt[0]) + rows(nxt[1])) == sorted(straight[2])


def test_map_feed_epochs_end_on_a_step_whatever_the_split():
    """40 samples, steps of 12: an epoch is 3 steps (36 samples) for every split of the step,
    and a resume after 4 steps with another split continues with the same samples. Before,
    micro batches of 4 also took samples 36-39 (a third of a step), micro batches of 12 none."""
    def feed(rank, world, micro):
        return MapFeed(_Draws(), train_sampler(_Draws(), 3, rank, world), micro, seed=3, rank=rank,
                       world_size=world, step_size=12, num_workers=0)

    def steps(world, micro, n, state=None):
        feeds = [feed(r, world, micro) for r in range(world)]
        for f in feeds:
            if state is not None:
                f.load_state_dict(state)
        its = [iter(f) for f in feeds]
        out = []
        for _ in range(n):
            rows = [(i, d) for it in its for _ in range(12 // (world * micro))
                    for i, d in zip(*(t.tolist() for t in next(it)))]
            out.append(sorted(rows))
        return out, feeds[0].state_dict()

    want, _ = steps(1, 12, 7)
    assert [e for e in (feed(0, 1, 12).micro_batches_per_epoch, feed(1, 2, 2).micro_batches_per_epoch)] == [3, 9]
    for world, micro in [(1, 4), (2, 2), (3, 1)]:
        assert steps(world, micro, 7)[0] == want, (world, micro)
    _, state = steps(1, 4, 4)
    assert state == {"epoch": 1, "position": 12}
    assert steps(2, 3, 3, state)[0] == want[4:]


# ---------------------------------------------------------------- the step plan and Trainer.offline


def test_the_engine_and_the_recipe_cards_count_with_one_step_plan(make_cfg, tmp_path):
    """The engine's split and steps are train.plan.step_plan's, a recipe card's for the same data
    too (repeated augmentation: an epoch of a multiple of 256 images), and Trainer.offline builds
    the run's model and optimizer groups from the config alone."""
    from train.plan import step_plan
    from train.recipe import Recipe

    (tmp_path / "run").mkdir()
    cfg = make_cfg(*TINY_VIT, "model=vitt_1L", "model.depth=1", "trainer.micro_batch_size=16",
                   "trainer.repeated_aug=3", "trainer.epochs=2")
    t = DeiT3Trainer(cfg).setup()
    assert isinstance(t.feed, Feed) and t.plan == step_plan(cfg, 1, t.feed.micro_batches_per_epoch)
    assert (t.micro_bs, t.accum, t.total_steps) == (16, 2, 2 * t.steps_per_epoch)
    card = Recipe(cfg, train_size=len(t.data.train))
    assert (card.micro_batch(), card.accum(), card.steps_per_epoch(), card.total_steps()) == \
        (t.micro_bs, t.accum, t.steps_per_epoch, t.total_steps)
    assert t.steps_per_epoch == len(t.data.train) // 256 * 256 // 32
    offline = DeiT3Trainer.offline(cfg)
    shapes = lambda opts: {k: [[p.shape for p in g["params"]] for g in o.param_groups] for k, o in opts.items()}  # noqa: E731
    assert shapes(offline.optimizers) == shapes(t.optimizers) and not offline.dist.is_main


# ---------------------------------------------------------------- results and generation


def test_per_layer_laplacian_counts_reach_results_json(make_cfg, tmp_path):
    import json

    run(make_cfg(*TINY_VIT, "model=vitt_0L", "model.num_laplacian_heads=[0,3]", "trainer.max_steps=1"))
    res = json.loads((tmp_path / "run/results.json").read_text())
    assert res["num_laplacian_heads"] == [0, 3]


@pytest.mark.cuda
def test_generate_top_k_zero_and_bad_temperature(device):
    from laplace import create_model

    model = create_model("gpt_d2_1L", vocab_size=50).to(device).eval()
    prompt = torch.tensor([[1, 2, 3]], device=device)
    g = torch.Generator(device).manual_seed(0)
    out = model.generate(prompt, 4, temperature=1.0, top_k=0, generator=g)
    assert out.shape == (1, 7)
    g.manual_seed(0)
    assert torch.equal(out, model.generate(prompt, 4, temperature=1.0, top_k=None, generator=g))
    with pytest.raises(ValueError, match="temperature=-1"):
        model.generate(prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k=-2"):
        model.generate(prompt, 2, top_k=-2)


@pytest.mark.slow
def test_augmentation_does_not_depend_on_the_number_of_workers(make_cfg, tmp_path):
    """3-Augment (RandomChoice draws from Python's `random`) and drop-path: the same losses with
    the images loaded in the main process, in one worker, or in two."""
    common = [*TINY_VIT, "model=vitt_1L", "model.depth=1", "data.augment=three_augment",
              "model.drop_path_rate=0.1", "trainer.max_steps=4", "trainer.eval_every=100"]
    for w in (0, 1, 2):
        run(make_cfg(*common, f"trainer.num_workers={w}", run_dir=tmp_path / f"w{w}"))
    assert _train(tmp_path / "w0") == _train(tmp_path / "w1") == _train(tmp_path / "w2")
