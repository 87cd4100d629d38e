"""lm-eval benchmarks (`python -m eval.lm`, eval/tasks/laplace_chat): the paper's chat protocol
on a tiny trained checkpoint, with local copies of the datasets in their hub formats; no network."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CONFIGS, ROOT

CHAT = ["laplace_chat_arc_easy", "laplace_chat_arc_challenge", "laplace_chat_mmlu", "laplace_chat_gsm8k",
        "laplace_chat_humaneval"]
HUMANEVAL_ROW = {"task_id": "HumanEval/0",
                 "prompt": "from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    \"\"\"Sum of xs.\"\"\"\n",
                 "canonical_solution": "    return sum(xs)\n",
                 "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate([2, 3]) == 5\n"
                         "    assert candidate([]) == 0\n",
                 "entry_point": "add"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for k in ("LAPLACE_ALLOW_CODE_EXECUTION", "HF_ALLOW_CODE_EVAL"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A 3-step gpt_d2_1L on the built-in help text with a 512-token BPE (chat specials included)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from laplace.data.prepare import prepare
    from train import run

    base = tmp_path_factory.mktemp("lm_ckpt")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        pcfg = compose("prepare", overrides=["source=pydoc", "vocab_size=512", f"out={base / 'data'}", "progress=false"])
    prepare(pcfg)
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[
            f"paths.runs_dir={base / 'runs'}", "experiment=gpt_tiny", "model=gpt_d2_1L", f"data.root={base / 'data'}",
            "data.vocab_size=512", "data.seq_len=64", "trainer.global_batch_size=4", "trainer.max_steps=3",
            "trainer.num_workers=0", "trainer.progress=false", "trainer.sample_prompts=[]"])
    with open_dict(cfg):
        cfg.run_dir = str(base / "runs" / "tiny")
    run(cfg)
    return base / "runs" / "tiny" / "ckpt" / "last.pt"


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory) -> Path:
    """Local copies in the hub repos' layouts and columns (a handful of rows each), as
    `hf download <repo> --repo-type dataset --local-dir DIR/<repo name>` leaves them (jsonl instead of parquet)."""
    root = tmp_path_factory.mktemp("hf")
    arc = [{"id": f"Mercury_{i}", "question": f"Which planet is number {i + 1} from the sun?",
            "choices": {"text": ["Mercury", "Venus", "Earth", "Mars"], "label": ["A", "B", "C", "D"]},
            "answerKey": "ABCD"[i]} for i in range(4)]
    arc.append({"id": "NYSED_1", "question": "Which is a gas?", "choices": {"text": ["ice", "steam", "rock"],
                "label": ["1", "2", "3"]}, "answerKey": "2"})  # a few ARC rows number their choices
    _write_jsonl(root / "ai2_arc/ARC-Easy/test.jsonl", arc)
    _write_jsonl(root / "ai2_arc/ARC-Challenge/test.jsonl", arc[:3])
    _write_jsonl(root / "mmlu/all/test.jsonl", [
        {"question": "What is 2 + 2?", "subject": "elementary_mathematics", "choices": ["3", "4", "5", "6"], "answer": 1},
        {"question": "H2O is", "subject": "high_school_chemistry", "choices": ["water", "salt", "air", "gold"], "answer": 0}])
    _write_jsonl(root / "gsm8k/main/test.jsonl", [
        {"question": "Tom has 2 apples and buys 3 more. How many apples does he have?",
         "answer": "He has 2+3=<<2+3=5>>5 apples.\n#### 5"},
        {"question": "A box holds 1,000 pins; 2 boxes?", "answer": "2*1000=<<2*1000=2000>>2000\n#### 2,000"}])
    _write_jsonl(root / "openai_humaneval/openai_humaneval/test.jsonl", [HUMANEVAL_ROW])
    return root


def _lm_cfg(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose("lm_eval", overrides=list(overrides))


# ---------------------------------------------------------------------------------------- CLI

def test_laplace_chat_group_cli_writes_results_the_tables_read(ckpt, hf_root, capsys):
    """tasks=[laplace_chat]: all five tasks run, the table is printed, results.json is written
    beside the run, and its average is the unweighted mean of the five accuracies."""
    import yaml

    from analysis.runs import collect, metric_value, read_run
    from train.cli import config_dir
    from eval.lm import evaluate_lm

    cfg = _lm_cfg(f"checkpoint={ckpt}", "tasks=[laplace_chat]", f"data_root={hf_root}", "allow_code_execution=true",
                  "max_gen_toks=8", "bootstrap_iters=0", "device=cpu", "batch_size=4")
    [record] = evaluate_lm(cfg)
    out = capsys.readouterr().out
    for name in CHAT + ["laplace_chat"]:
        assert name in out
    path = ckpt.parent.parent / "eval" / "lm_laplace_chat" / "results.json"
    assert f"wrote {path}" in out
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(record, default=str))
    assert saved["model"] == "gpt_d2_1L" and saved["num_laplacian_heads"] == 1 and saved["step"] == 3
    assert saved["laplacian_mode"] == "fixed" and saved["dataset"] and saved["checkpoint"] == str(ckpt)
    assert saved["lm_eval_version"]
    ns = {"laplace_chat_arc_easy": 5, "laplace_chat_arc_challenge": 3, "laplace_chat_mmlu": 2,
          "laplace_chat_gsm8k": 2, "laplace_chat_humaneval": 1}
    for name, n in ns.items():
        assert saved["tasks"][name]["n"] == n and saved["tasks"][name]["num_fewshot"] == 0
        assert 0.0 <= saved[f"{name}/acc"] <= 1.0
        assert saved["tasks"][name]["metrics"]["acc"]["value"] == saved[f"{name}/acc"]
    assert saved["tasks"]["laplace_chat"]["n"] == sum(ns.values())
    assert saved["laplace_chat/acc"] == pytest.approx(statistics.fmean(saved[f"{t}/acc"] for t in CHAT))
    assert saved["laplace_chat_humaneval/pass@1"] == saved["laplace_chat_humaneval/acc"]
    # ChatCORE: ARC and MMLU centred by chance 1/4, GSM8K and HumanEval by 0, then averaged
    centred = [(saved[f"{t}/acc"] - 0.25) / 0.75 for t in CHAT[:3]] + [saved[f"{t}/acc"] for t in CHAT[3:]]
    assert saved["laplace_chat/chatcore"] == pytest.approx(statistics.fmean(centred))
    assert f"ChatCORE {saved['laplace_chat/chatcore']:.4f}" in out
    # what analysis.tables reads: the run's record holds the flat keys
    metrics = read_run(ckpt.parent.parent)["metrics"]
    assert metrics["laplace_chat/acc"] == saved["laplace_chat/acc"]
    assert all(f"{t}/acc" in metrics for t in CHAT)
    # configs/tables.yaml's lm columns: the laplace_chat keys first, the average = laplace_chat/acc
    cols = {c["name"]: c for c in yaml.safe_load((config_dir("tables") / "tables.yaml").read_text())["tables"]["lm"]["columns"]}
    [rec] = [r for r in collect([ckpt.parent.parent]) if r["run_dir"] == str(ckpt.parent.parent)]
    assert metric_value(rec, cols["average"]["metric"]) == saved["laplace_chat/acc"]
    for col, task in zip(["arc_easy", "arc_challenge", "mmlu", "gsm8k", "humaneval"], CHAT):
        assert metric_value(rec, cols[col]["metric"]) == saved[f"{task}/acc"]


def test_two_checkpoints_two_results(ckpt, hf_root, tmp_path, capsys):
    from eval.lm import evaluate_lm

    other = tmp_path / "runs" / "second"
    shutil.copytree(ckpt.parent.parent / "ckpt", other / "ckpt")
    second = other / "ckpt" / "last.pt"
    cfg = _lm_cfg(f"checkpoint=[{ckpt},{second}]", "tasks=[laplace_chat_mmlu]", f"data_root={hf_root}",
                  "bootstrap_iters=0", "device=cpu", "limit=1")
    records = evaluate_lm(cfg)
    assert [r["checkpoint"] for r in records] == [str(ckpt), str(second)]
    for c in (ckpt, second):
        res = json.loads((c.parent.parent / "eval" / "lm_laplace_chat_mmlu_limit1" / "results.json").read_text())
        assert res["checkpoint"] == str(c) and res["tasks"]["laplace_chat_mmlu"]["n"] == 1
        assert "laplace_chat_mmlu/acc" in res
    assert records[0]["laplace_chat_mmlu/acc"] == records[1]["laplace_chat_mmlu/acc"]  # the same weights
    assert capsys.readouterr().out.count("[lm_eval] wrote") == 2


def test_cli_one_line_errors(ckpt, hf_root, tmp_path):
    """Missing checkpoint (a subprocess: the real command line), unknown task, HumanEval
    without allow_code_execution: one `error:` line, before any model is loaded."""
    from eval.lm import evaluate_lm
    from laplace.errors import ConfigError, UserError

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "eval.lm", f"checkpoint={tmp_path / 'nope.pt'}"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=120, check=False)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: checkpoint={tmp_path / 'nope.pt'}: no such file")
    assert "Traceback" not in p.stderr

    with pytest.raises(ConfigError, match=r"allow_code_execution=true") as e:
        evaluate_lm(_lm_cfg(f"checkpoint={ckpt}", "tasks=[laplace_chat]", f"data_root={hf_root}"))
    assert "laplace_chat_humaneval" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"unknown task 'laplace_chat_arc_esay' \(close: .*laplace_chat_arc_easy"):
        evaluate_lm(_lm_cfg(f"checkpoint={ckpt}", "tasks=[laplace_chat_arc_esay]"))
    with pytest.raises(UserError, match=r"data_root=.*: no folder .*mmlu \(the copy of cais/mmlu\)"):
        evaluate_lm(_lm_cfg(f"checkpoint={ckpt}", "tasks=[laplace_chat_mmlu]", f"data_root={tmp_path / 'none'}",
                            "device=cpu"))
    with pytest.raises(ConfigError, match="apply_chat_template=false"):
        evaluate_lm(_lm_cfg(f"checkpoint={ckpt}", "tasks=[laplace_chat_mmlu]", "apply_chat_template=true"))


def test_many_tasks_name_a_bounded_folder_checked_before_evaluation(ckpt, tmp_path, monkeypatch):
    """Task names joined past the file system's 255 characters: the output folder keeps the tag's
    start and a hash of the whole (as run directories do) and can be made; an output folder that
    cannot be written is refused before any evaluation, naming out=."""
    import lm_eval

    from eval.lm import evaluate_lm, out_dirs
    from laplace.errors import UserError

    names = [f"laplace_chat_task_number_{i:02d}" for i in range(12)]  # 12 x 27 characters
    cfg = _lm_cfg(f"checkpoint={ckpt}")
    (d,) = out_dirs(cfg, [ckpt], names)
    assert d.parent == ckpt.parent.parent / "eval" and len(d.name) <= 120 and d.name.startswith("lm_laplace_chat_")
    d.mkdir(parents=True)  # ENAMETOOLONG with the whole tag
    assert out_dirs(cfg, [ckpt], names[:-1]) != [d]  # another task list, another folder
    assert out_dirs(cfg, [ckpt], names) == [d]

    def evaluated(**kw):
        raise AssertionError("evaluated before checking the output folder")

    monkeypatch.setattr(lm_eval, "simple_evaluate", evaluated)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UserError, match=f"out: cannot write in {blocker}/lm .*give out="):
        evaluate_lm(_lm_cfg(f"checkpoint={ckpt}", "tasks=[laplace_pydoc]", f"out={blocker / 'lm'}", "device=cpu"))


def test_default_tasks_and_unknown_standard_name(ckpt, monkeypatch):
    """The default task list is lm-eval's standard five; humaneval makes it refuse without the
    flag (read from lm-eval's own YAML, no task built); a misspelt standard name lists close ones."""
    from eval.lm import STANDARD_TASKS, evaluate_lm, task_manager, unsafe_tasks
    from laplace.errors import ConfigError

    cfg = _lm_cfg(f"checkpoint={ckpt}")
    assert tuple(cfg.tasks) == STANDARD_TASKS and cfg.allow_code_execution is False
    tm = task_manager(list(STANDARD_TASKS) + ["laplace_chat"])
    assert unsafe_tasks(tm, list(STANDARD_TASKS) + ["laplace_chat"]) == ["humaneval", "laplace_chat_humaneval"]
    assert unsafe_tasks(tm, ["arc_easy", "mmlu", "gsm8k"]) == []
    with pytest.raises(ConfigError, match=r"tasks humaneval run model-generated code"):
        evaluate_lm(cfg)
    # lm-eval's humaneval needs evaluate's code_eval script (a hub download): offline, one line
    import evaluate

    def missing(name, *a, **k):
        raise FileNotFoundError(f"Couldn't find a module script at {name}/{name}.py.")

    monkeypatch.setattr(evaluate, "load", missing)
    with pytest.raises(ConfigError, match=r"code_eval metric, which cannot be loaded"):
        evaluate_lm(_lm_cfg(f"checkpoint={ckpt}", "tasks=[humaneval]", "allow_code_execution=true"))
    with pytest.raises(ConfigError, match=r"unknown task 'arc_esay' \(close: .*arc_easy"):
        task_manager(["arc_esay"])


# ---------------------------------------------------------------------------------------- simple_evaluate

MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{target}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 6, do_sample: false}}
metric_list:
  - metric: exact_match
"""


def test_simple_evaluate_with_the_adapter(ckpt, hf_root, tmp_path):
    """lm_eval.simple_evaluate(model="laplace") on a local multiple-choice task, a local
    generation task and a laplace_chat task (local data through the TaskManager's data_root)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import eval.lm_adapter  # noqa: F401
    from eval.lm import TASKS_DIR

    data = tmp_path / "tiny.jsonl"
    _write_jsonl(data, [{"question": "Is water wet?", "choices": ["yes", "no"], "answer": 0, "target": "yes"},
                        {"question": "What is the keyword for a loop?", "choices": ["for", "cat", "dog"], "answer": 0,
                         "target": "for"}])
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(MC_YAML.format(data=data))
    (tasks / "tiny_gen.yaml").write_text(GEN_YAML.format(data=data))
    tm = TaskManager(include_path=[str(tasks), str(TASKS_DIR)], include_defaults=False,
                     metadata={"data_root": str(hf_root)})
    res = lm_eval.simple_evaluate(model="laplace", model_args=f"checkpoint={ckpt},device=cpu,batch_size=4",
                                  tasks=["tiny_mc", "tiny_gen", "laplace_chat_arc_challenge"], task_manager=tm,
                                  bootstrap_iters=0, log_samples=True)
    r = res["results"]
    assert 0 <= r["tiny_mc"]["acc,none"] <= 1 and 0 <= r["tiny_gen"]["exact_match,none"] <= 1
    assert 0 <= r["laplace_chat_arc_challenge"]["acc,none"] <= 1
    assert res["n-samples"]["laplace_chat_arc_challenge"]["effective"] == 3
    # the chat task's requests: the rendered prompt, then each bare letter
    sample = res["samples"]["laplace_chat_arc_challenge"][0]
    contexts = {a[0] for a in sample["arguments"]}
    assert len(contexts) == 1 and next(iter(contexts)).endswith("<|assistant_start|>")
    assert [a[1] for a in sample["arguments"]] == ["A", "B", "C", "D"]


# ---------------------------------------------------------------------------------------- scoring

def _chat_tasks(hf_root, *names):
    from lm_eval.tasks import TaskManager

    from eval.lm import TASKS_DIR

    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"data_root": str(hf_root)})
    return tm.load(list(names))["tasks"]


def test_letter_prompts_are_nanochats_rendering_and_argmax_scoring(ckpt, hf_root):
    """The multiple-choice prompt encodes to exactly render_for_completion's ids (nanochat's
    render_mc as the user turn) and the letters are scored by argmax, dataset labels kept."""
    from eval.lm_adapter import LaplaceLM
    from laplace.chat_format import render_for_completion
    from laplace.data.chat import ARC, MMLU

    tasks = _chat_tasks(hf_root, "laplace_chat_arc_easy", "laplace_chat_mmlu")
    arc, mmlu = tasks["laplace_chat_arc_easy"], tasks["laplace_chat_mmlu"]
    lm = LaplaceLM(checkpoint=str(ckpt), device="cpu")
    for task, cls in ((arc, ARC([])), (mmlu, MMLU([]))):
        for doc in task.test_docs():
            conv = cls.conversation(doc)
            assert lm.tok_encode(task.doc_to_text(doc)) == render_for_completion(lm.tok, conv)
            assert task.doc_to_choice(doc) == list(conv["letters"])
            gold = task.doc_to_target(doc)
            assert task.doc_to_choice(doc)[gold] == conv["messages"][-1]["content"]
    docs = list(arc.test_docs())
    numbered = docs[-1]  # labels 1-3, answer "2"
    assert arc.doc_to_choice(numbered) == ["1", "2", "3"] and arc.doc_to_target(numbered) == 1
    assert arc.process_results(numbered, [(-3.0, False), (-0.5, False), (-1.0, False)])["acc"] == 1.0
    assert arc.process_results(numbered, [(-0.2, False), (-0.5, False), (-1.0, False)])["acc"] == 0.0
    first = docs[0]  # answer A
    assert arc.process_results(first, [(-0.1, True), (-2.0, False), (-2.0, False), (-5.0, False)])["acc"] == 1.0
    assert mmlu.config.target_delimiter == ""  # the letter right after <|assistant_start|>


def test_gsm8k_scorer():
    from importlib import import_module

    u = import_module("eval.tasks.laplace_chat.utils")
    assert u.extract_gsm8k_answer("so 3+4=7\n#### 7") == "7"
    assert u.extract_gsm8k_answer("#### 1,234 apples") == "1234"
    assert u.extract_gsm8k_answer("#### -5") == "-5"
    assert u.extract_gsm8k_answer("the answer is 7") is None
    doc = {"question": "q", "answer": "2*1000=<<2*1000=2000>>2000\n#### 2,000"}
    assert u.gsm8k_process_results(doc, ["It is 2000.\n#### 2000"]) == {"acc": 1.0}
    assert u.gsm8k_process_results(doc, ["#### 2,000<|assistant_end|>"]) == {"acc": 1.0}
    assert u.gsm8k_process_results(doc, ["#### 200"]) == {"acc": 0.0}
    assert u.gsm8k_process_results(doc, ["2000"]) == {"acc": 0.0}  # no #### answer: wrong, as nanochat
    assert u.gsm8k_prompt(doc) == "<|bos|><|user_start|>q<|user_end|><|assistant_start|>"


def test_humaneval_runs_code_only_with_the_flag(monkeypatch, hf_root):
    from importlib import import_module

    from laplace.errors import UserError

    u = import_module("eval.tasks.laplace_chat.utils")
    good = "Here it is:\n```python\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```\nDone."
    bad = "def add(xs):\n    return 0\n"
    # refused without the flag: scoring, and loading the data (before any generation)
    with pytest.raises(u.CodeExecutionRefused, match="allow_code_execution=true") as e:
        u.humaneval_process_results(HUMANEVAL_ROW, [good])
    assert "LAPLACE_ALLOW_CODE_EXECUTION=1" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="allow_code_execution=true"):  # lm-eval's own copy of utils.py
        _chat_tasks(hf_root, "laplace_chat_humaneval")
    monkeypatch.setenv("LAPLACE_ALLOW_CODE_EXECUTION", "1")
    # the program: the prompt's imports, the reply's code block, the test, check(entry_point)
    program = u.humaneval_program(HUMANEVAL_ROW, good)
    assert program.startswith("from typing import List\n\ndef add(") and program.endswith("check(add)")
    assert u.humaneval_process_results(HUMANEVAL_ROW, [good]) == {"acc": 1.0, "pass@1": 1.0}
    assert u.humaneval_process_results(HUMANEVAL_ROW, [bad]) == {"acc": 0.0, "pass@1": 0.0}
    assert u.run_program("while True:\n    pass\n", timeout=1.0) is False  # killed at the timeout
    task = _chat_tasks(hf_root, "laplace_chat_humaneval")["laplace_chat_humaneval"]
    assert task.UNSAFE_CODE  # lm-eval also wants confirm_run_unsafe_code=True


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """True once `pid` has ended (a zombie waiting for its reaper counts as ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("then", ["while True:\n    pass\n", "print('done')\n"])
def test_sandbox_kills_what_the_program_started(tmp_path, monkeypatch, then):
    """HumanEval's program starts a `sleep 30` of its own, then loops past the timeout or ends:
    either way the sleep does not outlive run_program."""
    from importlib import import_module

    u = import_module("eval.tasks.laplace_chat.utils")
    monkeypatch.setenv("LAPLACE_ALLOW_CODE_EXECUTION", "1")
    pid_file = tmp_path / "sleep.pid"
    program = (f"import subprocess\np = subprocess.Popen(['sleep', '30'])\n"
               f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n" + then)
    t0 = time.monotonic()
    assert u.run_program(program, timeout=3.0) is (then.startswith("print"))
    assert time.monotonic() - t0 < 20
    assert _gone(int(pid_file.read_text())), "the program's sleep survived"


def test_builtin_laplace_pydoc_group_needs_no_data(ckpt, capsys):
    """tasks=[laplace_pydoc]: the offline evaluation on the held-out help topics (multiple choice
    in the chat format; rolling log-likelihood of whole documents)."""
    from eval.lm import evaluate_lm
    from laplace.data.chat import PydocChat
    from laplace.data.text import pydoc_documents

    cfg = _lm_cfg(f"checkpoint={ckpt}", "tasks=[laplace_pydoc]", "bootstrap_iters=0", "device=cpu", "batch_size=8")
    [saved] = evaluate_lm(cfg)
    n_mc = sum(r["kind"] == "mc" for r in PydocChat("val").rows)
    assert saved["tasks"]["laplace_pydoc_mc"]["n"] == n_mc > 10
    assert saved["tasks"]["laplace_pydoc_text"]["n"] == len(pydoc_documents(train=False))
    assert 0.0 <= saved["laplace_pydoc_mc/acc"] <= 1.0
    assert 0.5 < saved["laplace_pydoc_text/bits_per_byte"] < 12  # 3 steps: far from the 8 bits of chance
    assert "laplace_pydoc_text" in capsys.readouterr().out


def test_an_exported_folder_scores_as_its_checkpoint(ckpt, tmp_path, capsys):
    """eval.lm on a `python -m laplace.export` folder: the same numbers as on the checkpoint, the
    tokenizer the folder's tokenizer.json, results.json in <folder>/eval with the run's fields."""
    from eval.lm import evaluate_lm
    from laplace.export import export

    out = export(ckpt, tmp_path / "export")
    kw = ["tasks=[laplace_pydoc]", "bootstrap_iters=0", "device=cpu", "limit=4"]
    [want] = evaluate_lm(_lm_cfg(f"checkpoint={ckpt}", *kw, f"out={tmp_path / 'from_ckpt'}"))
    [got] = evaluate_lm(_lm_cfg(f"checkpoint={out}", *kw))
    saved = json.loads((out / "eval" / "lm_laplace_pydoc_limit4" / "results.json").read_text())
    assert saved == json.loads(json.dumps(got, default=str)) and saved["checkpoint"] == str(out)
    assert (saved["model"], saved["num_laplacian_heads"], saved["step"]) == ("gpt_d2_1L", 1, 3)
    assert saved["dataset"] == want["dataset"] and saved["tasks"] == want["tasks"]
    assert saved["laplace_pydoc_text/bits_per_byte"] == want["laplace_pydoc_text/bits_per_byte"]
    assert f"[lm_eval] {out} (step 3)" in capsys.readouterr().out


def test_chatcore_known_values():
    from eval.lm import chatcore

    accs = dict(zip(CHAT, [1.0, 0.25, 0.4, 0.5, 0.0]))
    assert chatcore({f"{t}/acc": a for t, a in accs.items()}) == {"laplace_chat/chatcore": pytest.approx(0.34)}
    assert chatcore({f"{CHAT[0]}/acc": 1.0}) == {}  # not all five: no ChatCORE
