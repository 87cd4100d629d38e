"""The paper's LM protocol (nanochat's chat evaluation of a fine-tuned model) as lm-eval tasks.

Every prompt is the chat rendering `laplace.chat_format.render_for_completion` gives, written with the
special tokens' strings: `<|bos|><|user_start|>USER<|user_end|><|assistant_start|>` (the
`laplace` model adapter maps those strings to their ids). Zero-shot, as nanochat's chat_eval.

    ARC-Easy, ARC-Challenge, MMLU   the user turn is nanochat's `render_mc` prompt; the score is
                                    the log-likelihood of each answer letter right after
                                    `<|assistant_start|>` (nanochat compares those letters'
                                    logits at that position: the same argmax); metric acc.
    GSM8K                           greedy generation until `<|assistant_end|>`; acc = the number
                                    after `####` in the reply equals the reference's (commas
                                    removed), nanochat's GSM8K reward.
    HumanEval                       the user turn is the function's prompt; the reply's code (the
                                    first ```python block, or the whole reply) runs after the
                                    prompt's imports with the test and `check(entry_point)` in a
                                    subprocess with a timeout; acc = pass@1 (greedy).

Data: the hub datasets through `datasets`, or local copies in the hub layout (`data_root=DIR`).
Generated code runs only when asked: HumanEval is `unsafe_code` and, besides, needs
LAPLACE_ALLOW_CODE_EXECUTION=1 (`python -m eval.lm allow_code_execution=true` sets it).
"""
import contextlib
import itertools
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile

from laplace.chat_format import chat_prompt_text as chat_prompt  # one user turn, the assistant's opened
from laplace.data import DatasetNotFoundError
from laplace.data.chat import render_mc
from laplace.errors import UserError

ALLOW_ENV = "LAPLACE_ALLOW_CODE_EXECUTION"
TIMEOUT_S = 5.0          # nanochat's execute_code: 5 s per program
MEMORY_BYTES = 1 << 30   # address-space cap of a program (nanochat: 256 MB; 1 GB: Python + numpy fit)


class CodeExecutionRefused(UserError, RuntimeError):
    """HumanEval asked for without the code-execution flag."""


def require_code_execution() -> None:
    if os.environ.get(ALLOW_ENV, "") != "1":
        raise CodeExecutionRefused(
            f"laplace_chat_humaneval runs model-generated code: pass allow_code_execution=true to python -m eval.lm "
            f"(or set {ALLOW_ENV}=1 and confirm_run_unsafe_code=True), or leave the task out")


# ---------------------------------------------------------------------------------- data

def load_dataset(repo: str, subset: str | None = None, split: str = "test", data_root: str | None = None,
                 **_metadata):
    """{split: datasets.Dataset} of one hub dataset (the tasks' `custom_dataset`): `repo` from the
    hub (or its cache), or the local copy `<data_root>/<repo name>` (`hf download <repo>
    --repo-type dataset --local-dir DIR/<repo name>`: parquet or jsonl)."""
    import datasets

    from laplace.data.chat import load_split

    if repo == "openai/openai_humaneval":  # refuse before any model work, not after generating
        require_code_execution()
    name = repo.split("/")[-1]
    if data_root:  # lm-eval passes the TaskManager's metadata (eval.lm's data_root=)
        path = os.path.join(os.path.expanduser(str(data_root)), name)
        if not os.path.isdir(path):
            raise DatasetNotFoundError(f"data_root={data_root}: no folder {path} (the copy of {repo}); make it "
                                       f"with `hf download {repo} --repo-type dataset --local-dir {path}`")
        return datasets.DatasetDict({split: load_split(path, subset, split, key="data_root")})
    try:
        return datasets.DatasetDict({split: load_split(repo, subset, split, key="repo")})
    except DatasetNotFoundError as e:
        reason = str(e).split(": ", 2)[-1].split("; offline")[0]
        raise DatasetNotFoundError(
            f"{repo} ({subset}, {split}): {reason}; offline, fill the HF cache (HF_DATASETS_OFFLINE=1 then "
            f"reads it) or download a copy, `hf download {repo} --repo-type dataset "
            f"--local-dir DIR/{name}`, and pass data_root=DIR") from None


# ---------------------------------------------------------------------------------- prompts
# The letters and the answer's index are jinja in the YAMLs: an ARC row's own labels (a few use 1-4).

def arc_prompt(doc) -> str:
    return chat_prompt(render_mc(doc["question"], doc["choices"]["label"], doc["choices"]["text"]))


def mmlu_prompt(doc) -> str:
    return chat_prompt(render_mc(doc["question"], "ABCD"[:len(doc["choices"])], doc["choices"]))


def gsm8k_prompt(doc) -> str:
    return chat_prompt(doc["question"])


def humaneval_prompt(doc) -> str:
    return chat_prompt(doc["prompt"])


# ---------------------------------------------------------------------------------- GSM8K

GSM_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_gsm8k_answer(text: str) -> str | None:
    """nanochat's `extract_answer`: the number after the first `#### `, commas removed."""
    m = GSM_RE.search(text)
    return m.group(1).strip().replace(",", "") if m else None


def gsm8k_process_results(doc, results) -> dict:
    pred = extract_gsm8k_answer(results[0])  # no #### answer: wrong, as nanochat
    return {"acc": float(pred is not None and pred == extract_gsm8k_answer(doc["answer"]))}


# ---------------------------------------------------------------------------------- HumanEval

_CODE_BLOCK = re.compile(r"```(?:python)?\s*\n(.*?)\n```", re.DOTALL)


def humaneval_program(doc, completion: str) -> str:
    """The prompt's imports + the reply's code + the test + check(entry_point), as nanochat assembles it."""
    # the import lines at the top of the prompt: those before its first line of anything else
    top = itertools.takewhile(lambda s: not s or s.startswith(("import ", "from ", "#")),
                              (line.strip() for line in doc["prompt"].split("\n")))
    imports = [s for s in top if s.startswith(("import ", "from "))]
    blocks = _CODE_BLOCK.findall(completion)  # the first ```python (or ```) block, else the whole reply
    code = (blocks[0] if blocks else completion).strip()
    return "\n".join(imports) + "\n\n" + code + "\n\n" + doc["test"] + "\n" + f"check({doc['entry_point']})"


def _limit_memory():  # in the child, before exec
    with contextlib.suppress(ValueError, OSError):  # a hard limit below ours: keep it
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def run_program(program: str, timeout: float = TIMEOUT_S) -> bool:
    """Run a program in a fresh isolated Python (`-I`) in an empty temporary folder, with a
    timeout and a memory cap; True when it exits 0. Refuses without the code-execution flag."""
    require_code_execution()
    with tempfile.TemporaryDirectory(prefix="laplace_humaneval_") as tmp:
        # a file, not `-c`: a reply with a NUL byte fails as Python code, not in Popen (ValueError)
        path = os.path.join(tmp, "program.py")
        with open(path, "w") as f:
            f.write(program)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "HOME": tmp,
               "OMP_NUM_THREADS": "1"}
        # POSIX: the program leads its own session (process group), killed when it times out and
        # also when it ends, so nothing it started (a `sleep`, a server) outlives the check. A program
        # that starts a new session of its own escapes: the timeout is no sandbox against malice.
        proc = subprocess.Popen([sys.executable, "-I", path], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_limit_memory)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already empty
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return code == 0


def humaneval_process_results(doc, results) -> dict:
    ok = float(run_program(humaneval_program(doc, results[0])))
    return {"acc": ok, "pass@1": ok}
