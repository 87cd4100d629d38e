"""slurm/ on a real Slurm: a one-node cluster started for this module (tests/slurm_cluster.py)
runs our own scripts with a tiny CPU model. Checked: a job signalled part-way that checkpoints,
requeues itself and ends with the losses of an uninterrupted job, with one srun task and with two
(DDP, signalled twice); a dependent chain (train -> fine-tune -> analysis) whose stages run in
order; a sweep; Hydra's submitit launcher, on the cluster and locally. Where Slurm cannot run
(not installed, not root) the cluster tests skip and say why; CI (.ci/run) installs it. About 3
minutes on 2 cores.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, Unavailable

ROOT = Path(__file__).resolve().parent.parent
# The tiny ViT of conftest.TINY_VIT on the built-in digits, run as a job: ~30 ms a step on a core.
TINY = ["trainer.device=cpu", "trainer.num_workers=0", "model.depth=2", "model.embed_dim=48",
        "trainer.global_batch_size=32", "trainer.log_every=1", "trainer.progress=false",
        "trainer.eval_every=1000", "trainer.ckpt_every=1000"]


@pytest.fixture(scope="module")
def cluster():
    c = SlurmCluster(cpus=8)  # 8 task slots on 2 cores: the jobs of a test run side by side
    try:
        c.start()
    except Unavailable as e:
        pytest.skip(f"no Slurm cluster here: {e}")
    yield c
    leftovers = c.stop()
    assert not leftovers, f"processes still running after the cluster stopped: {leftovers}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slurm-runs")


def site_env(base: dict, runs: Path) -> dict:
    """slurm/config.sh's settings for this machine: CPU-only tasks of one core, this Python's venv."""
    env = {k: v for k, v in base.items() if not k.startswith("LAPLACE_")}
    env.update(LAPLACE_GPUS_PER_NODE="0", LAPLACE_CPUS_PER_TASK="1", LAPLACE_TIME="10",
               LAPLACE_RUNS=str(runs), LAPLACE_VENV=sys.prefix, LAPLACE_SBATCH_EXTRA="")
    return env


@pytest.fixture(scope="module")
def submit(cluster, runs):
    """submit("sweep.sh", *args) -> the job ids the script prints."""
    if not (Path(sys.prefix) / "bin/activate").exists():
        pytest.skip(f"the jobs activate a venv and {sys.prefix} is none")
    env = site_env(cluster.env, runs)

    def _submit(script: str, *args: str) -> list[str]:
        proc = subprocess.run(["bash", str(ROOT / "slurm" / script), *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    return _submit


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r.get("split") == "train"]


def log(runs: Path, name: str, job: str) -> str:
    return (runs / "slurm" / f"{name}-{job}.out").read_text()


def wait_for_steps(run_dir: Path, n: int, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(train_losses(run_dir)) >= n:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{run_dir} did not reach step {n} in {timeout:.0f} s")


def until(cond, what: str, timeout: float = 120, info=lambda: ""):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s {info()}"
        time.sleep(0.3)


# ---------------------------------------------------------------- the scripts, with no cluster


def test_gpt_d20_chain_stages_and_opt_in_code_execution(tmp_path):
    """slurm/chains/gpt_d20.sh: pre-train -> mid -> SFT -> benchmarks (one GPU) -> analysis; data.root
    reaches pre-training only; HumanEval (laplace_chat) only with --allow-code-execution."""
    env = {**site_env(os.environ, tmp_path), "LAPLACE_DRY_RUN": "1", "LAPLACE_GPUS_PER_NODE": "8"}

    def stages(*args):
        proc = subprocess.run(["bash", "slurm/chains/gpt_d20.sh", "gpt_d20_5L", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return [ln for ln in proc.stderr.splitlines() if ln.startswith("sbatch")]

    pre, mid, sft, bench, analysis = stages("data.root=/d", "seed=1")
    assert "experiment=gpt_d20 model=gpt_d20_5L data.root=/d seed=1" in pre
    assert "experiment=gpt_d20_mid" in mid and "data.root=/d" not in mid and "/1_gpt_d20/ckpt/last.pt" in mid
    assert "experiment=gpt_d20_sft" in sft and "/2_gpt_d20_mid/ckpt/last.pt" in sft
    assert "--ntasks-per-node=1 --gpus-per-node=1" in bench and "/3_gpt_d20_sft/ckpt/last.pt" in bench
    assert "laplace_chat_gsm8k" in bench and "humaneval" not in bench and "allow_code_execution" not in bench
    assert "analysis.sbatch" in analysis and "/1_gpt_d20/ckpt/last.pt" in analysis
    bench = stages("--allow-code-execution", "data.root=/d")[3]
    assert "tasks=\\[laplace_chat\\]" in bench and "allow_code_execution=true" in bench
    env["LAPLACE_GPUS_PER_NODE"] = "0"  # a CPU-only site: no GPU request, which such a cluster refuses
    assert "--gpus-per-node=1" not in stages("data.root=/d")[3]


def sbatch_words(stderr: str) -> list[tuple[list[str], list[str]]]:
    """The dry-run sbatch lines as (sbatch flags, script arguments), unquoted as the shell would."""
    out = []
    for line in (ln for ln in stderr.splitlines() if ln.startswith("sbatch")):
        words = shlex.split(line)
        at = next(i for i, w in enumerate(words) if w.endswith(".sbatch"))
        out.append((words[1:at], words[at + 1:]))
    return out


def test_chain_names_and_folders_are_valid_hydra_overrides(tmp_path):
    """The README's chain (gpt_d20.sh ... --allow-code-execution data.root=...) with the opt-in after
    an sbatch flag and runs in a folder whose name has '&' and '=': every stage's overrides parse in
    Hydra and name the right folders; the opt-in reaches eval.lm, not sbatch."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    runs = tmp_path / "r&d=1"
    env = {**site_env(os.environ, runs), "LAPLACE_DRY_RUN": "1"}
    proc = subprocess.run(["bash", "slurm/chains/gpt_d20.sh", "gpt_d20_5L", "--nodes=2", "--allow-code-execution",
                           "data.root=/data/fineweb_edu", "seed=1"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    stages = sbatch_words(proc.stderr)
    assert len(stages) == 5 and not any("--allow-code-execution" in f for f, _ in stages)
    chain = runs / "chains/gpt_d20_gpt_d20_5L_data.root--data-fineweb_edu_s1"
    parser = OverridesParser.create()
    values = []
    for _, args in stages:
        overrides = [a for a in args if "=" in a]  # python -m eval.lm: the words before are the command
        values.append({o.key_or_group: o.value() for o in parser.parse_overrides(overrides)})
    assert [v.get("run_dir") for v in values[:3]] == [str(chain / d) for d in ("1_gpt_d20", "2_gpt_d20_mid",
                                                                                "3_gpt_d20_sft")]
    assert values[1]["trainer.init_from"] == str(chain / "1_gpt_d20/ckpt/last.pt")
    assert values[3]["checkpoint"] == str(chain / "3_gpt_d20_sft/ckpt/last.pt")
    assert values[3]["allow_code_execution"] is True and values[3]["tasks"] == ["laplace_chat"]
    assert values[4]["checkpoint"] == str(chain / "1_gpt_d20/ckpt/last.pt")
    assert values[0]["data.root"] == "/data/fineweb_edu" and "data.root" not in values[1]


def test_submit_composes_site_flags_and_lets_the_command_line_win(tmp_path):
    env = {**site_env(os.environ, tmp_path), "LAPLACE_DRY_RUN": "1", "LAPLACE_GPUS_PER_NODE": "4",
           "LAPLACE_GPU_TYPE": "h100", "LAPLACE_PARTITION": "gpu", "LAPLACE_TIME": "48:00:00",
           "LAPLACE_SBATCH_EXTRA": "--qos=high --mem=0"}

    def dry(*args):
        proc = subprocess.run(["bash", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split(), proc.stderr

    _, cmd = dry("slurm/submit.sh", "--time=1:00:00", "train.sbatch", "experiment=deit3_in1k")
    assert "--gpus-per-node=h100:4 --ntasks-per-node=4 --cpus-per-task=1 --time=48:00:00 --partition=gpu " \
           "--qos=high --mem=0 --time=1:00:00 " + str(ROOT / "slurm/train.sbatch") + " experiment=deit3_in1k" in cmd
    assert f"--chdir={ROOT} --output={tmp_path}/slurm/%x-%j.out" in cmd and "--account" not in cmd
    _, cmd = dry("slurm/submit.sh", "analysis.sbatch", "checkpoint=x")  # #LAPLACE max-gpus-per-node=1
    assert "--gpus-per-node=h100:1 --ntasks-per-node=1 " in cmd
    # A chain: each stage after the one before, {N} -> stage N's folder, run_dir for training stages.
    ids, cmd = dry("slurm/chain.sh", "--name=c", "::", "train.sbatch", "seed=1", "::", "--nodes=2", "train.sbatch",
                   "trainer.init_from={1}/ckpt/last.pt", "::", "analysis.sbatch", "checkpoint={prev}/ckpt/last.pt")
    lines = [l for l in cmd.splitlines() if l.startswith("sbatch")]
    assert len(ids) == 3 and len(lines) == 3
    assert lines[0].endswith(f"seed=1 run_dir={tmp_path}/chains/c/1_train ") and "--dependency" not in lines[0]
    assert f"--dependency=afterok:{ids[0]} --kill-on-invalid-dep=yes --nodes=2 " in lines[1]
    assert f"trainer.init_from={tmp_path}/chains/c/1_train/ckpt/last.pt run_dir={tmp_path}/chains/c/2_train" in lines[1]
    assert f"afterok:{ids[1]}" in lines[2] and lines[2].endswith(f"checkpoint={tmp_path}/chains/c/2_train/ckpt/last.pt ")
    ids, cmd = dry("slurm/sweep.sh", "--heads", "0,12", "--seeds", "0,1", "--", "experiment=deit3_cifar100")
    assert len(ids) == 4 and cmd.count("--job-name=vitb_12L_s1 ") == 1 and "model=vitb_0L seed=1" in cmd


def test_submit_without_sbatch_says_so_in_one_line(tmp_path):
    """issue 47: off a Slurm machine, one line saying what is missing and what to do (status 1), not
    bash's `sbatch: command not found` (127). The PATH holds the tools submit.sh uses, no sbatch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "sed", "cut", "mkdir"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {**site_env(os.environ, tmp_path), "PATH": str(bin_dir)}
    proc = subprocess.run([shutil.which("bash"), "slurm/submit.sh", "train.sbatch", "experiment=deit3_in1k"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == ["submit.sh: Slurm's sbatch is not on the PATH: submit from the cluster's "
                                        "login node (or load its Slurm module); LAPLACE_DRY_RUN=1 prints the sbatch "
                                        "command instead"]


# ---------------------------------------------------------------- on the cluster


@pytest.fixture(scope="module")
def chain(cluster, submit, runs):
    """A 3-stage chain (train.sbatch -> run.sbatch python train.py, fine-tuning stage 1's
    checkpoint -> analysis.sbatch) whose first stage gets SIGUSR1 part-way, and the same first
    stage as a separate job that nobody signals. Returns (chain job ids, reference job id, stage folders)."""
    steps = 80
    stage1 = [*TINY, "model=vitt_1L", f"trainer.max_steps={steps}"]
    ids = submit("chain.sh", "--name=order", "::", "train.sbatch", *stage1,
                 "::", "run.sbatch", "python", "train.py", *TINY, "model=vitt_1L", "trainer.max_steps=3",
                 "trainer.init_from={1}/ckpt/last.pt",
                 "::", "analysis.sbatch", "checkpoint={2}/ckpt/last.pt", "max_tokens=2000", "figures=false")
    (ref,) = submit("submit.sh", "--job-name=reference", "train.sbatch", *stage1, f"run_dir={runs}/reference")
    dirs = [runs / "chains/order/1_train", runs / "chains/order/2_run"]
    wait_for_steps(dirs[0], 3)
    cluster.run("scancel", "--signal=USR1", ids[0])  # reaches the srun tasks, like the time-limit warning
    cluster.wait(*ids, ref, timeout=240)
    return ids, ref, dirs


@pytest.mark.slow
def test_signalled_job_requeues_and_resumes_exactly(cluster, chain, runs):
    (first, *_), ref, dirs = chain
    info, ref_info = cluster.job(first), cluster.job(ref)
    out = log(runs, "train", first)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out[-3000:]
    assert ref_info["JobState"] == "COMPLETED" and ref_info["Restarts"] == "0"
    assert "saved step" in out and "requeueing job" in out and "resumed at step" in out
    resumed, straight = train_losses(dirs[0]), train_losses(runs / "reference")
    assert [s for s, _ in resumed] == list(range(1, 81))  # every step once: the log was cut at the checkpoint
    assert resumed == straight  # bit-identical losses
    assert json.loads((dirs[0] / "results.json").read_text())["steps"] == 80


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_task_job_signalled_twice_requeues_and_resumes(cluster, submit, runs):
    """train.sbatch with 2 srun tasks and a data worker each: `scancel --signal=USR1` part-way, then
    `--signal=TERM` in the requeued run (both reach every process of the step, workers included).
    Each time both ranks stop at the same step and srun passes 75 on (the first task to end must not
    get the other killed with another status), the job requeues, and the third start ends with the
    losses of the same job left alone."""
    args = [*TINY, "model=vitt_1L", "trainer.max_steps=60", "trainer.num_workers=1"]
    (job,) = submit("submit.sh", "--ntasks-per-node=2", "--job-name=pre2", "train.sbatch", *args,
                    f"run_dir={runs}/pre2")
    (ref,) = submit("submit.sh", "--ntasks-per-node=2", "--job-name=ref2", "train.sbatch", *args,
                    f"run_dir={runs}/ref2")
    stopped = 0
    for restarts, sig in enumerate(("USR1", "TERM")):
        until(lambda: cluster.job(job).get("JobState") == "RUNNING" and
              cluster.job(job).get("Restarts") == str(restarts), what=f"start {restarts + 1} of {job}")
        wait_for_steps(runs / "pre2", stopped + 3, timeout=120)
        cluster.run("scancel", f"--signal={sig}", job)
        until(lambda: log(runs, "pre2", job).count("requeueing job") == restarts + 1, what=f"requeue after {sig}",
              info=lambda: log(runs, "pre2", job)[-3000:])
        stopped = int(log(runs, "pre2", job).rsplit("saved step ", 1)[1].split(",")[0])
    info, ref_info = cluster.wait(job, ref, timeout=300)
    out = log(runs, "pre2", job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", out[-3000:]
    assert ref_info["JobState"] == "COMPLETED", log(runs, "ref2", ref)[-3000:]
    assert out.count("requeueing job") == 2 and out.count("resumed at step") == 2
    assert "global batch 32 = 16 x 2 x 1 accum" in out  # DDP over the two srun tasks
    assert json.loads((runs / "pre2/results.json").read_text())["steps"] == 60
    resumed = train_losses(runs / "pre2")
    assert [s for s, _ in resumed] == list(range(1, 61))
    assert resumed == train_losses(runs / "ref2")


@pytest.mark.slow
def test_chain_runs_its_stages_in_order(cluster, chain, runs):
    ids, _, dirs = chain
    infos = [cluster.job(j) for j in ids]
    assert [i["JobState"] for i in infos] == ["COMPLETED"] * 3, [log(runs, n, j)[-2000:] for n, j in
                                                                zip(["train", "run", "analysis"], ids)]
    # Each stage started once the one before had ended (its requeue included); times in whole seconds.
    for before, after in zip(infos, infos[1:]):
        assert after["StartTime"] >= before["EndTime"], (before, after)
    assert f"initialised from laplace checkpoint {dirs[0]}/ckpt/last.pt" in log(runs, "run", ids[1])
    analysis = json.loads((dirs[1] / "ckpt/last_analysis/analysis.json").read_text())
    assert analysis["model"] == "vitt_d2_w48_1L" and "[analysis] wrote" in log(runs, "analysis", ids[2])


@pytest.mark.slow
def test_readme_gpt_chain_with_a_data_root_override_runs(cluster, tmp_path):
    """The shape of the README's `bash slurm/chains/gpt_d20.sh MODEL --allow-code-execution data.root=...`,
    tiny: pre-training on pydoc shards given by data.root= -> fine-tuning from {1} -> analysis of
    {1}, the chain named from stage 1 (no --name) and the runs in a folder with '&' and '='."""
    if not (Path(sys.prefix) / "bin/activate").exists():
        pytest.skip(f"the jobs activate a venv and {sys.prefix} is none")
    shards, runs = tmp_path / "pydoc", tmp_path / "r&d=1"
    subprocess.run([sys.executable, "prepare.py", "source=pydoc", "vocab_size=512", f"out={shards}",
                    "progress=false"], cwd=ROOT, check=True, capture_output=True, timeout=120)
    gpt = ["experiment=gpt_tiny", "model=gpt_d2_1L", f"data.root={shards}", "data.vocab_size=512",
           "data.seq_len=64", "trainer.global_batch_size=4", "trainer.sample_prompts=[]", "trainer.device=cpu",
           "trainer.log_every=1", "trainer.progress=false", "trainer.eval_every=1000", "trainer.ckpt_every=1000"]
    proc = subprocess.run(["bash", "slurm/chain.sh", "--nodes=1", "::", "train.sbatch", *gpt, "trainer.max_steps=3",
                           "::", "train.sbatch", *gpt, "trainer.max_steps=2", "trainer.init_from={1}/ckpt/last.pt",
                           "::", "analysis.sbatch", "checkpoint={1}/ckpt/last.pt", "max_tokens=2000", "figures=false"],
                          env=site_env(cluster.env, runs), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    ids = proc.stdout.split()
    infos = cluster.wait(*ids, timeout=240)
    logs = [log(runs, n, j)[-2000:] for n, j in zip(["gpt_tiny", "gpt_tiny", "analysis"], ids)]
    assert [i["JobState"] for i in infos] == ["COMPLETED"] * 3, logs
    (chain,) = (runs / "chains").iterdir()
    assert chain.name.startswith("gpt_tiny_gpt_d2_1L_") and "data.root-" in chain.name and "=" not in chain.name
    assert json.loads((chain / "1_gpt_tiny/results.json").read_text())["steps"] == 3
    assert f"initialised from laplace checkpoint {chain}/1_gpt_tiny/ckpt/last.pt" in logs[1]
    assert json.loads((chain / "2_gpt_tiny/results.json").read_text())["steps"] == 2
    assert (chain / "1_gpt_tiny/ckpt/last_analysis/analysis.json").exists()


@pytest.mark.slow
def test_sweep_submits_one_job_per_model_and_seed(cluster, submit, runs):
    ids = submit("sweep.sh", "--models", "vitt_0L,vitt_1L", "--seeds", "0,1", "--", *TINY, "trainer.max_steps=2")
    assert len(set(ids)) == 4 and all(i.isdigit() for i in ids)
    infos = cluster.wait(*ids, timeout=180)
    assert [i["JobState"] for i in infos] == ["COMPLETED"] * 4
    assert sorted(i["JobName"] for i in infos) == ["vitt_0L_s0", "vitt_0L_s1", "vitt_1L_s0", "vitt_1L_s1"]
    results = sorted(p.parent.name.split("_model")[0] for p in (runs / "deit3/digits").glob("*/results.json"))
    assert results == ["vitt_0L_s0", "vitt_0L_s1", "vitt_1L_s0", "vitt_1L_s1"]


# ---------------------------------------------------------------- Hydra's submitit launcher


def multirun(launcher: str, runs: Path, env: dict) -> subprocess.CompletedProcess:
    """`python train.py -m hydra/launcher=<launcher>` over two models, with slurm/config.sh sourced."""
    cmd = ["python", "train.py", "-m", f"hydra/launcher={launcher}", "model=vitt_0L,vitt_1L", *TINY,
           "model.depth=1", "trainer.max_steps=2", f"paths.runs_dir={runs}"]
    return subprocess.run(["bash", "-c", 'source slurm/config.sh && exec "$@"', "bash", *cmd], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def check_multirun(proc: subprocess.CompletedProcess, runs: Path):
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted((runs / "deit3/digits").glob("*/results.json"))
    assert [p.parent.name.split("_s0")[0] for p in results] == ["vitt_0L", "vitt_1L"]
    assert [json.loads(p.read_text())["num_laplacian_heads"] for p in results] == [0, 1]


@pytest.mark.slow
def test_submitit_launcher_submits_a_multirun_to_slurm(cluster, tmp_path):
    env = {**site_env(cluster.env, tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = multirun("cluster", tmp_path, env)
    check_multirun(proc, tmp_path)
    (script,) = (tmp_path / "multirun/.submitit").glob("*/*_submission.sh")
    text = script.read_text()
    assert "#SBATCH --signal=USR1@120" in text and "#SBATCH --gpus-per-node=0" in text and "run_or_requeue" in text


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_multirun(tmp_path):
    env = {**site_env(os.environ, tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    check_multirun(multirun("local", tmp_path, env), tmp_path)
