"""eval.lm_adapter: our GPT checkpoints under lm-evaluation-harness, every number checked against a
direct computation from the model's logits. One tiny checkpoint per module, made by the real
pipeline (BPE on the built-in help text -> shards -> 3 training steps)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import CONFIGS, ROOT

pytest.importorskip("lm_eval")

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
TASK = "laplace_tiny_mc"
DOCS = [{"question": "The for statement", "choices": [" is", " class", " of"], "answer": 0},
        {"question": "A class is", "choices": [" a", " the", " return value"], "answer": 1},
        {"question": "Lists are", "choices": [" mutable", " 42"], "answer": 0}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """python prepare.py source=pydoc vocab_size=512, then 3 steps of gpt_d2_1L."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from laplace.data.prepare import prepare
    from train import run

    root = tmp_path_factory.mktemp("lm_adapter")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        prep = compose("prepare", overrides=["source=pydoc", "vocab_size=512", f"out={root / 'data'}",
                                             "progress=false"])
    prepare(prep)
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[
            f"paths.runs_dir={root / 'runs'}", "experiment=gpt_tiny", "model=gpt_d2_1L",
            f"data.root={root / 'data'}", "data.vocab_size=512", "data.seq_len=64", "data.val_tokens=1024",
            "trainer.global_batch_size=4", "trainer.max_steps=3", "trainer.num_workers=0",
            "trainer.progress=false", "trainer.sample_prompts=[]", "trainer.device=cpu"])
    with open_dict(cfg):
        cfg.run_dir = str(root / "run")
    run(cfg)
    return root / "run" / "ckpt" / "last.pt"


@pytest.fixture(scope="module")
def ref(ckpt):
    """(model, tokenizer) loaded independently of the adapter."""
    from laplace.tokenizer import tokenizer_from_config
    from laplace.checkpoint import load_checkpoint, load_model

    return load_model(ckpt), tokenizer_from_config(load_checkpoint(ckpt)["config"])


def _lm(ckpt, **kw):
    from eval.lm_adapter import LaplaceLM

    return LaplaceLM(str(ckpt), device="cpu", **kw)


def _req(kind, *args):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


@torch.no_grad()
def _score(model, ctx_ids, cont_ids, max_length=64):
    """log P(cont | ctx) and whether each cont token is the argmax, from one unbatched forward."""
    seq = (ctx_ids + cont_ids)[-(max_length + 1):]
    logp = model(torch.tensor([seq[:-1]]))[0].float().log_softmax(-1)[-len(cont_ids):]
    target = torch.tensor(cont_ids)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def _pair_ids(tok, context, continuation):
    """lm-eval's HF split, by hand: trailing spaces to the continuation, bos first, whole - context;
    when nothing would follow the context, split where the two encodings part."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    ctx = [tok.bos_id] + tok.encode(context)
    whole = [tok.bos_id] + tok.encode(context + continuation)
    if whole[len(ctx):]:
        return ctx, whole[len(ctx):]
    n = next(i for i, (a, b) in enumerate(zip(ctx, whole)) if a != b)
    return whole[:n], whole[n:]


PAIRS = [("The for", " statement"),   # plain
         ("", "The for statement"),   # empty context: <|bos|> alone
         ("A class is ", "a"),        # trailing space moves to the continuation
         ("Hello wor", "ld"),         # the continuation starts mid-word
         ("A cla", "ss is"),          # crosses a token boundary: whole encoding != context's
         ("return val", "ue"),        # merges into the context's last token: split where they part
         ("import", " os\nimport sys\n" * 3),
         ("x", "")]                   # nothing to score: log 1 = 0


def test_loglikelihood_matches_logits(ckpt, ref):
    model, tok = ref
    # the two boundary cases really are: the context's ids are not a prefix of the whole's
    for ctx, cont in [("A cla", "ss is"), ("return val", "ue")]:
        c, w = [tok.bos_id] + tok.encode(ctx), [tok.bos_id] + tok.encode(ctx + cont)
        assert w[:len(c)] != c
    want = [_score(model, *_pair_ids(tok, c, x)) if x else (0.0, True) for c, x in PAIRS]
    for bs in (1, 2, 3):
        got = _lm(ckpt, batch_size=bs).loglikelihood([_req("loglikelihood", c, x) for c, x in PAIRS])
        assert [g for _, g in got] == [g for _, g in want]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4)


def test_loglikelihood_greedy_and_shared_contexts(ckpt, ref):
    """A continuation made of the model's own greedy tokens is greedy; several one-token
    continuations of one context (answered by one forward) are each exact, in order."""
    model, tok = ref
    ctx = [tok.bos_id] + tok.encode("The for statement")
    greedy = model.generate(torch.tensor([ctx]), 4, temperature=0)[0, len(ctx):].tolist()
    text = tok.decode(greedy)
    assert tok.encode("The for statement" + text)[len(ctx) - 1:] == greedy  # round-trips here
    lm = _lm(ckpt, batch_size=2)
    (lp, is_greedy), = lm.loglikelihood([_req("loglikelihood", "The for statement", text)])
    assert is_greedy and lp == pytest.approx(_score(model, ctx, greedy)[0], abs=1e-4)
    choices = [" a", " b", " c", " d", " is", " class"]
    reqs = [_req("loglikelihood", "A class is", c) for c in choices]
    got = lm.loglikelihood(reqs)
    want = [_score(model, *_pair_ids(tok, "A class is", c)) for c in choices]
    assert [g for _, g in got] == [g for _, g in want]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4)


def test_loglikelihood_left_truncates(ckpt, ref):
    model, tok = ref
    context, cont = "The for statement is used to iterate. " * 6, "Lists are mutable"
    ctx, cont_ids = _pair_ids(tok, context, cont)
    assert len(ctx) + len(cont_ids) > 17
    (lp, g), = _lm(ckpt, max_length=16).loglikelihood([_req("loglikelihood", context, cont)])
    want = _score(model, ctx, cont_ids, max_length=16)
    assert (lp, g) == (pytest.approx(want[0], abs=1e-4), want[1])
    from laplace.errors import ConfigError

    with pytest.raises(ConfigError, match="exceeds max_length=16"):  # cannot fit: refused, not cut
        _lm(ckpt, max_length=16).loglikelihood([_req("loglikelihood", "A", " list" * 20)])


@torch.no_grad()
def test_loglikelihood_rolling_sums_windows(ckpt, ref):
    model, tok = ref
    text = "The for statement iterates over the items of any sequence, in order. " * 6
    t = tok.encode(text)
    L = 64
    assert len(t) > 2 * L  # three windows at least
    seq, total, p = [tok.bos_id] + t, 0.0, 0
    while p < len(t):  # each token predicted once, with as much context as fits in L
        end = min(p + L, len(t))
        inp = seq[max(0, end - L):end]
        logp = model(torch.tensor([inp]))[0].log_softmax(-1)[-(end - p):]
        total += float(logp.gather(1, torch.tensor(t[p:end])[:, None]).sum())
        p = end
    short = "Lists are mutable."
    short_ids = tok.encode(short)
    want_short = _score(model, [tok.bos_id], short_ids)[0]
    got = _lm(ckpt, batch_size=2).loglikelihood_rolling(
        [_req("loglikelihood_rolling", text), _req("loglikelihood_rolling", short)])
    assert got == pytest.approx([total, want_short], abs=1e-3)


def test_generate_until_is_greedy_generation(ckpt, ref):
    model, tok = ref
    prompt = "The for statement"
    ids = [tok.bos_id] + tok.encode(prompt)
    new = model.generate(torch.tensor([ids]), 24, temperature=0)[0, len(ids):].tolist()
    stops = {tok.bos_id, tok.special_id("<|assistant_end|>")}
    if any(i in stops for i in new):
        new = new[:min(new.index(i) for i in stops if i in new)]
    full = tok.decode(new)
    assert len(full) > 6
    stop = full[3:6]
    lm = _lm(ckpt)
    got = lm.generate_until([
        _req("generate_until", prompt, {"until": [], "max_gen_toks": 24}),
        _req("generate_until", prompt, {"until": [stop], "max_gen_toks": 24, "do_sample": False}),
        _req("generate_until", prompt, {"until": ["\x00never"], "max_gen_toks": 5}),
    ])
    assert got == [full, full.split(stop)[0], tok.decode(new[:5])]


def test_chat_template_round_trips_to_sft_ids(ckpt, ref):
    from laplace.chat_format import render_conversation, render_for_completion

    _, tok = ref
    lm = _lm(ckpt)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a class?"},
                {"role": "assistant", "content": "A template."}, {"role": "user", "content": "And éa list?"}]
    text = lm.apply_chat_template(messages)
    assert text.startswith("<|bos|><|user_start|>Be brief.\n\nWhat is a class?<|user_end|>")
    assert text.endswith("<|user_start|>And éa list?<|user_end|><|assistant_start|>")
    assert lm.tok_encode(text) == render_for_completion(tok, {"messages": messages})
    prefill = messages[:2] + [{"role": "assistant", "content": "Answer:"}]
    open_ = lm.apply_chat_template(prefill, add_generation_prompt=False)
    assert open_.endswith("<|assistant_start|>Answer:")
    assert lm.tok_encode(open_) == render_conversation(tok, {"messages": prefill}, max_tokens=None)[0][:-1]
    assert lm.tokenizer_name.startswith("laplace-bpe-") and "<|assistant_start|>" in lm.chat_template(True)


def test_encode_with_specials(ref):
    from laplace.tokenizer import load_tokenizer

    _, bpe = ref
    for tok in (bpe, load_tokenizer("bytes")):
        sid = tok.special_id
        text = "<|bos|>hi <|user_start|>x <|user_end|><|assistant_start|>é"
        ids = tok.encode_with_specials(text)
        assert ids == [tok.bos_id, *tok.encode("hi "), sid("<|user_start|>"), *tok.encode("x "),
                       sid("<|user_end|>"), sid("<|assistant_start|>"), *tok.encode("é")]
        assert tok.decode(ids) == text
        assert tok.encode_with_specials("plain text") == tok.encode("plain text")
        assert tok.bos_id not in tok.encode(text)  # plain encode still never makes specials


def _task_dir(tmp_path):
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    return tmp_path


def _expected_acc(ref):
    model, tok = ref
    hits = 0
    for d in DOCS:  # lm-eval: context "question", continuation " " + choice (target_delimiter " ")
        scores = [_score(model, *_pair_ids(tok, d["question"], " " + c))[0] for c in d["choices"]]
        hits += max(range(len(scores)), key=scores.__getitem__) == d["answer"]
    return hits / len(DOCS)


def test_simple_evaluate_multiple_choice(ckpt, ref, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import eval.lm_adapter  # noqa: F401  (registers "laplace")

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    out = lm_eval.simple_evaluate(
        model="laplace", model_args=f"checkpoint={ckpt},device=cpu,batch_size=2", tasks=[TASK],
        task_manager=TaskManager(include_path=str(_task_dir(tmp_path)), include_defaults=False),
        bootstrap_iters=0)
    res = out["results"][TASK]
    assert res["acc,none"] == pytest.approx(_expected_acc(ref))
    assert out["config"]["model_num_parameters"] == sum(p.numel() for p in ref[0].parameters())


@pytest.mark.slow  # a fresh interpreter (and lm-eval's task index) per process
def test_cli_module_runs_lm_eval(ckpt, ref, tmp_path):
    """python -m eval.lm_adapter: lm-eval's own CLI with the model registered."""
    env = {**os.environ, **OFFLINE}
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "eval.lm_adapter", "--model", "laplace", "--model_args",
         f"checkpoint={ckpt},device=cpu", "--tasks", TASK, "--include_path", str(_task_dir(tmp_path)),
         "--batch_size", "3", "--output_path", str(out)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert TASK in proc.stdout
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1
    assert results[0]["results"][TASK]["acc,none"] == pytest.approx(_expected_acc(ref))


DDP_SCRIPT = """
import json, os, sys
import lm_eval
from lm_eval.tasks import TaskManager
from eval.lm_adapter import LaplaceLM

ckpt, tasks, task, out_dir = sys.argv[1:5]
seen = {}
plain = LaplaceLM.loglikelihood
def counted(self, requests, **kw):  # how many requests this rank scores
    seen.update(world_size=self.world_size, requests=len(requests))
    return plain(self, requests, **kw)
LaplaceLM.loglikelihood = counted
out = lm_eval.simple_evaluate(model="laplace", model_args=f"checkpoint={ckpt},device=cpu,batch_size=2",
                              tasks=[task], bootstrap_iters=0, log_samples=True,
                              task_manager=TaskManager(include_path=tasks, include_defaults=False))
if out is not None:
    seen.update(acc=out["results"][task]["acc,none"], samples=len(out["samples"][task]))
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:  # no interleaved stdout
    json.dump(seen, f)
"""


@pytest.mark.slow  # a fresh interpreter (and lm-eval's task index) per process
def test_torchrun_data_parallel(ckpt, ref, tmp_path):
    """torchrun, 2 CPU processes (gloo): each scores its shard of the documents, rank 0 alone gets
    the metrics of all of them (lm-eval's data parallelism for custom models)."""
    script = tmp_path / "ddp_eval.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
         str(ckpt), str(_task_dir(tmp_path)), TASK, str(tmp_path)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    n_choices = sum(len(d["choices"]) for d in DOCS)
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["requests"] < n_choices and r1["requests"] < n_choices  # each scores its shard
    assert "acc" not in r1  # rank 1 returns None
    assert r0["acc"] == pytest.approx(_expected_acc(ref)) and r0["samples"] == len(DOCS)


def test_bf16_autocast_close_to_fp32(ckpt):
    """dtype=bfloat16 (the CUDA default) runs the same code under autocast: scores agree to bf16
    rounding, and generation with the KV cache runs."""
    reqs = [_req("loglikelihood", c, x) for c, x in PAIRS[:4]]
    fp32, bf16 = _lm(ckpt), _lm(ckpt, dtype="bfloat16")
    assert [lp for lp, _ in bf16.loglikelihood(reqs)] == pytest.approx(
        [lp for lp, _ in fp32.loglikelihood(reqs)], abs=0.05, rel=0.01)
    out, = bf16.generate_until([_req("generate_until", "The for", {"until": [], "max_gen_toks": 8})])
    assert isinstance(out, str) and out
