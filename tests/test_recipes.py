"""Recipe cards (train/recipe.py): every experiment composes, and every row of its card is equal
to the reference or says why not; the behaviours a card states are held by tests here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import laplace

from train import recipe as R

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = R.experiments()


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_card_has_no_unexplained_row(experiment):
    ref, rows = R.card(experiment)
    bad = [f"{r.name}: ours {r.ours!r} vs ref {r.ref!r} ({r.status})" for r in rows if not r.ok]
    assert not bad, f"configs/reference/{experiment}.yaml: " + "; ".join(bad)
    assert len(rows) >= 8, "a card compares the recipe hyper-parameter by hyper-parameter"
    # docs/recipes keeps the rendered cards: regenerate with `python -m train.recipe --all`
    rendered = ROOT / "docs" / "recipes" / f"{experiment}.md"
    assert rendered.is_file() and rendered.read_text() == R.render(experiment, ref, rows), \
        f"{rendered} is stale: run python -m train.recipe --all"


def test_held_by_names_tests_that_exist():
    for path in sorted(R.REFERENCES.glob("*.yaml")):
        for row in R.yaml.safe_load(path.read_text())["rows"]:
            if "held_by" not in row:
                continue
            file, _, name = row["held_by"].partition("::")
            tree = ast.parse((ROOT / file).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in names, f"{path.name}: {row['name']!r} is held by {row['held_by']}, which does not exist"


def test_a_differing_row_without_reason_is_flagged(tmp_path):
    cfg = R.compose_config(["experiment=deit3_in1k"])
    rec = R.Recipe(cfg, train_size=1281167)
    rows = R.evaluate_rows(rec, [
        {"name": "lr", "ours": "optim.lr", "ref": 1.0e-3},                              # differs, no reason
        {"name": "lr2", "ours": "optim.lr", "ref": 1.0e-3, "deliberate": "why"},        # explained
        {"name": "wd", "ours": "optim.weight_decay", "ref": 0.05, "deliberate": "x"},    # equal: stale reason
        {"name": "peak", "ours": "@sched(optim.schedules.lr, 5ep)", "ref": 3.0e-3},     # computed, equal
    ], "test")
    assert [r.status for r in rows] == ["DIFFERS", "deliberate", "STALE", "equal"]
    with pytest.raises(R.ConfigError, match="ours_is needs held_by"):
        R.evaluate_rows(rec, [{"name": "x", "ours_is": "y", "ref": "y"}], "test")
    with pytest.raises(R.ConfigError, match="no such key"):
        R.evaluate_rows(rec, [{"name": "x", "ours": "optim.nope", "ref": 1}], "test")


def test_cli_prints_a_card_and_refuses_a_missing_one(capsys):
    assert R.main(["experiment=deit3_in1k"]) == 0
    out = capsys.readouterr().out
    assert "| = | peak lr (not scaled with the batch) | 0.003 | 0.003 |" in out
    with pytest.raises(R.ConfigError, match="give one experiment=NAME"):
        R.main([])


# ---- behaviours the cards state (held_by) -------------------------------------------------
def test_vit_initialises_as_timm_deit3():
    """Class token ~ N(0, 1e-6) (timm's deit3), position embeddings on the patches only."""
    from laplace import create_model

    torch.manual_seed(0)
    m = create_model("vitb_0L", num_classes=10, img_size=192)
    assert m.cls_token.std().item() < 1e-5
    assert m.pos_embed.shape == (1, (192 // 16) ** 2, 768)


def test_three_augment_has_no_random_erasing():
    from laplace.data.transforms import three_augment

    names = [type(t).__name__ for t in three_augment(32).transforms]
    assert not any("Erasing" in n for n in names), names


def test_deit3_trainer_keeps_no_ema():
    """No EMA copy: the DeiT-III trainer neither updates one after the step nor saves one."""
    from train.engine import Trainer
    from train.deit3 import DeiT3Trainer

    assert DeiT3Trainer.configure_optimizers is Trainer.configure_optimizers  # no optimizer hook: no EMA
    assert DeiT3Trainer.build_model is Trainer.build_model  # the zoo model alone: no EMA copy in it


def test_gpt_keeps_nanochats_dtypes_under_bf16_autocast(monkeypatch):
    """Under autocast the residual stream, the rotary tables as used (so q and k out of rotary)
    and the KV cache are bf16, as nanochat keeps them; without autocast all float32. The stored
    tables and the embedding weight stay float32 (nanochat: bf16 tables, a bf16 wte on CUDA)."""
    from laplace import attention, create_model

    seen, rotary = [], attention.apply_rotary
    monkeypatch.setattr(attention, "apply_rotary", lambda x, cos, sin: seen.append((x.dtype, cos.dtype))
                        or rotary(x, cos, sin))
    m = create_model("gpt_d2_0L", vocab_size=64, max_seq_len=16)
    idx = torch.randint(0, 64, (1, 8))
    for amp, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        seen.clear()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            feats = laplace.features(m, idx, norm=False)
            cache = m.new_kv_cache(1, 8)
        assert {f.dtype for f in feats.values()} == {dtype} and cache.kv.dtype == dtype
        assert set(seen) == {(dtype, dtype)}
    assert m.rope_cos.dtype == m.rope_sin.dtype == m.wte.weight.dtype == torch.float32


def test_bits_per_byte_counts_true_utf8_bytes():
    """A token holding part of a multi-byte character counts its own bytes (nanochat: 3)."""
    from laplace.tokenizer import load_tokenizer

    tok = load_tokenizer("bytes")
    text = "naïve café — ∑ 日本"
    ids = tok.encode(text)
    assert int(tok.token_bytes()[ids].sum()) == len(text.encode("utf-8"))
    assert tok.decode([ids[2]]) == "\ufffd" and int(tok.token_bytes()[ids[2]]) == 1  # half of "ï"


def test_pos_embed_resampling_is_deits_bicubic():
    """192 -> 224 px: the grid 12x12 -> 14x14 as deit's --finetune interpolates it."""
    import torch.nn.functional as F

    from laplace import create_model
    from laplace.vit import load_timm_state_dict

    torch.manual_seed(0)
    small, big = create_model("vitt_0L", num_classes=10, img_size=192), create_model("vitt_0L", num_classes=10)
    sd = small.state_dict()
    sd["pos_embed"] = torch.randn_like(sd["pos_embed"])
    load_timm_state_dict(big, sd)
    grid = sd["pos_embed"].reshape(1, 12, 12, -1).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(14, 14), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).flatten(1, 2)
    torch.testing.assert_close(big.pos_embed.data, want)


def test_author_recipe_mixes_as_timms_mixup_and_soft_bce():
    """experiment=deit3_in1k_author: timm's train.py with --mixup 0.8 --cutmix 1.0 --smoothing 0.1
    --bce-loss builds Mixup(label_smoothing=0.1) and BinaryCrossEntropy(target_threshold=None):
    ours gives the same images, soft targets and loss from the same NumPy draws."""
    import numpy as np
    from timm.data import Mixup
    from timm.loss import BinaryCrossEntropy

    from train.deit3 import build_criterion, build_mixup

    tc = R.compose_config(["experiment=deit3_in1k_author"]).trainer
    ours = build_mixup(tc, 1000), build_criterion(tc, 1000)
    theirs = (Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode="batch",
                    label_smoothing=0.1, num_classes=1000), BinaryCrossEntropy(target_threshold=None))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 1000, (8,), generator=g)
    head = torch.randn(3 * 32 * 32, 1000, generator=g) / 50
    for seed in range(6):
        out = []
        for mixup, loss in (ours, theirs):
            np.random.seed(seed)
            xm, ym = mixup(x.clone(), y.clone())
            out.append((xm, ym, loss(xm.flatten(1) @ head, ym)))
        for a, b in zip(*out):
            assert torch.equal(a, b), seed
        ym = out[0][1]
        assert ym.min() >= 1e-4 - 1e-9 and ym.max() < 1  # smoothed and mixed, not binarised


def test_channels_last_input_gives_the_same_logits():
    """A ViT sees a 4-D tensor only in its patch-embedding convolution: the memory layout
    (timm's --channels-last) changes no logit beyond float rounding."""
    from laplace import create_model

    torch.manual_seed(0)
    model = create_model("vitt_0L", qk_norm=True, img_size=64, num_classes=10, depth=2).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x.contiguous(memory_format=torch.channels_last)), model(x),
                                   rtol=1e-5, atol=1e-5)
