"""CORE (eval/core.py): a small bundle in nanochat's layout, hand-computed answers, the command,
and, with LAPLACE_NANOCHAT=<a nanochat checkout>, nanochat's own core_eval beside ours."""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CONFIGS, save_tiny_gpt

from laplace.core_eval import evaluate, render
from laplace.checkpoint import load_model
from laplace.tokenizer import load_tokenizer

# Answers under `Repeat` (below): multiple choice picks the choice with most repeated letters,
# schema the context whose last letter starts the continuation, language modelling is right when
# every continuation letter repeats the one before it.
TASKS = {
    "mc": ("multiple_choice", 1, " ", 25, [  # 3 of 4 right (q2's gold is the unrepeated choice)
        {"query": "q1", "choices": ["zzzz", "xyz"], "gold": 0}, {"query": "q2", "choices": ["abc", "kkkk"], "gold": 0},
        {"query": "q3", "choices": ["mn", "pppp"], "gold": 1}, {"query": "q4", "choices": ["rrrr", "st"], "gold": 0}]),
    "schema": ("schema", 0, "", 50, [  # 1 of 2
        {"context_options": ["xa", "xb"], "continuation": "bbb", "gold": 1},
        {"context_options": ["yc", "yd"], "continuation": "ccc", "gold": 1}]),
    "lm": ("language_modeling", 0, "", 0, [  # 2 of 3 ("ab " is trimmed before "bbb")
        {"context": "ab ", "continuation": "bbb"}, {"context": "cd", "continuation": "de"},
        {"context": "q", "continuation": "qq"}]),
}


def make_bundle(root: Path, tasks: dict) -> Path:
    """`tasks` {label: (type, shots, delimiter, baseline %, items)} as nanochat's eval_bundle folder."""
    (root / "eval_data").mkdir(parents=True)
    icl = []
    for label, (kind, shots, delim, _, items) in tasks.items():
        (root / "eval_data" / f"{label}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
        icl.append({"label": label, "dataset_uri": f"{label}.jsonl", "num_fewshot": [shots],
                    "icl_task_type": kind, "continuation_delimiter": delim})
    (root / "core.yaml").write_text(yaml.safe_dump({"icl_tasks": icl}))
    rows = "".join(f"{label},{t[3]}\n" for label, t in tasks.items())
    (root / "eval_meta_data.csv").write_text("Eval Task,Random baseline\n" + rows)
    return root


class Repeat(torch.nn.Module):
    """A model that predicts the current byte again (logit 10 for it, 0 for the rest)."""

    def __init__(self, max_seq_len=None):
        super().__init__()
        self.anchor, self.max_seq_len = torch.nn.Parameter(torch.zeros(1)), max_seq_len

    def forward(self, ids):
        return 10.0 * torch.nn.functional.one_hot(ids, 257).float()


@pytest.mark.parametrize("max_seq_len", [None, 8])  # 8: every prompt is cut to its last 8 tokens
def test_hand_computed(tmp_path, max_seq_len):
    res = evaluate(Repeat(max_seq_len), load_tokenizer("bytes"), make_bundle(tmp_path, TASKS))
    assert res["results"] == {"mc": 0.75, "schema": 0.5, "lm": pytest.approx(2 / 3)}
    # centred by the random baseline: (acc - b) / (1 - b)
    assert res["centered_results"] == pytest.approx({"mc": 2 / 3, "schema": 0.0, "lm": 2 / 3})
    assert res["core_metric"] == pytest.approx(4 / 9)


def test_render():
    shot = TASKS["mc"][4][0]
    assert render(TASKS["mc"][4][2], "multiple_choice", " ", [shot]) == ["q1 zzzz\n\nq3 mn", "q1 zzzz\n\nq3 pppp"]
    assert render({"context": " a ", "continuation": "b"}, "language_modeling", ": ",
                  [{"context": "c  ", "continuation": "d"}]) == ["c: d\n\na:", "c: d\n\na: b"]


def test_command(tmp_path, monkeypatch, capsys):
    from hydra import compose, initialize_config_dir

    from eval.core import evaluate_core
    from laplace.errors import UserError

    ckpt = save_tiny_gpt(tmp_path / "run" / "ckpt" / "last.pt")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("core", overrides=[f"checkpoint={ckpt}", "max_per_task=2", f"bundle={tmp_path / 'none'}"])
    # offline without a bundle: one line naming the key, before the model is read
    monkeypatch.setattr(torch.hub, "download_url_to_file", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    none = tmp_path / "none"
    with pytest.raises(UserError, match=f"^bundle={none}: no CORE eval bundle .* could not be downloaded") as e:
        evaluate_core(cfg)
    assert "\n" not in str(e.value)
    cfg.bundle = str(make_bundle(tmp_path / "b", TASKS))
    res = evaluate_core(cfg)
    assert "| CORE" in capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "eval" / "core_max2" / "results.json").read_text())
    assert saved["results"] == res["results"] and set(res["results"]) == set(TASKS) and saved["max_per_task"] == 2
    assert (tmp_path / "run" / "eval" / "core_max2" / "core.md").read_text().startswith("| task")


def _random_tasks(seed: int = 0) -> dict:
    """Random letter tasks of the three types, with few-shot, large enough to disagree if ours did."""
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 6)))  # noqa: E731
    mc = [{"query": word(), "choices": [word() for _ in range(4)], "gold": rng.randrange(4)} for _ in range(24)]
    schema = [{"context_options": [word() for _ in range(2)], "continuation": word(), "gold": rng.randrange(2)}
              for _ in range(24)]
    lm = [{"context": word() + " ", "continuation": rng.choice("ab") * rng.randint(1, 2)} for _ in range(24)]
    return {"mc": ("multiple_choice", 3, " ", 25, mc), "schema": ("schema", 2, " ", 50, schema),
            "lm": ("language_modeling", 0, "", 0, lm), "lm_shots": ("language_modeling", 2, " ", 0, lm)}


@pytest.mark.skipif(not os.environ.get("LAPLACE_NANOCHAT"), reason="LAPLACE_NANOCHAT=<nanochat checkout> not set")
@pytest.mark.parametrize("max_seq_len", [None, 40])
def test_equals_nanochat(tmp_path, max_seq_len):
    sys.path.insert(0, os.environ["LAPLACE_NANOCHAT"])
    from nanochat.core_eval import evaluate_task

    tok = load_tokenizer("bytes")

    class NanochatTokenizer:  # our byte tokenizer behind nanochat's call signature
        def get_bos_token_id(self):
            return tok.bos_id

        def __call__(self, texts, prepend):
            return [[prepend, *tok.encode(t)] for t in texts]

    model = load_model(save_tiny_gpt(tmp_path / "last.pt")).eval()  # nanochat's signature: model(ids) -> logits
    model.max_seq_len = max_seq_len
    tasks = _random_tasks()
    for item in tasks["lm"][4][::2]:  # half the continuations are the model's greedy next letter, so some are right
        t = model(torch.tensor([tok.encode(item["context"].strip(), prepend_bos=True)]))[0, -1].argmax().item()
        item["continuation"] = chr(t) if 32 < t < 127 else item["continuation"]
    ours = evaluate(model, tok, make_bundle(tmp_path / "bundle", tasks), max_per_task=20)
    for label, (kind, shots, delim, _, items) in tasks.items():
        data = list(items)
        random.Random(1337).shuffle(data)  # base_eval's order and cut
        meta = {"task_type": kind, "num_fewshot": shots, "continuation_delimiter": delim}
        theirs = evaluate_task(model, NanochatTokenizer(), data[:20], torch.device("cpu"), meta)
        print(f"[nanochat] {label} max_seq_len={max_seq_len}: ours {ours['results'][label]:.4f}, nanochat {theirs:.4f}")
        assert ours["results"][label] == theirs


def test_training_reports_core(make_cfg, tmp_path):
    """trainer.core_metric_every: CORE at the final evaluation, in the val record and results.json."""
    from train import run as train_run

    bundle = make_bundle(tmp_path / "bundle", TASKS)
    cfg = make_cfg("experiment=gpt_pydoc", "model=gpt_d2_1L", "data.seq_len=32", "trainer.global_batch_size=8",
                   "trainer.num_workers=0", "trainer.progress=false", "trainer.max_steps=2", "trainer.eval_every=1",
                   "trainer.sample_prompts=[]", "trainer.core_metric_every=5", f"trainer.core_bundle={bundle}")
    train_run(cfg)
    run = Path(cfg.run_dir)
    vals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in vals if "val_loss" in r]
    assert ["core_metric" in r for r in vals] == [False, True]  # step 1: not a multiple of 5; step 2: the last
    expected = evaluate(load_model(run / "ckpt" / "last.pt"), load_tokenizer("bytes"), bundle)["core_metric"]
    assert json.loads((run / "results.json").read_text())["final"]["core_metric"] == pytest.approx(expected)
    from analysis.runs import read_run  # the lm table's CORE column (configs/tables.yaml) reads it

    assert read_run(run)["metrics"]["final.core_metric"] == pytest.approx(expected)


@pytest.mark.slow  # a torchrun of two processes
def test_two_ranks_share_the_examples(tmp_path):
    import subprocess

    from conftest import ROOT

    ckpt = save_tiny_gpt(tmp_path / "run" / "ckpt" / "last.pt")
    bundle = make_bundle(tmp_path / "b", _random_tasks())
    one = evaluate(load_model(ckpt).eval(), load_tokenizer("bytes"), bundle)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "eval.core",
                          f"checkpoint={ckpt}", f"bundle={bundle}", "device=cpu", f"out={tmp_path / 'out'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["results"] == one["results"]
