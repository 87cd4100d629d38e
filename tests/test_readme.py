"""README.md is the door (issue 47): at most 300 lines, every command it shows runs as far as its
arguments go, its Python block runs, and its links and docs/'s point at files that exist.

A command is checked the way its program reads it, in this process, without training or data:
- `python train.py ...` (also inside `python -m train.launch` and `slurm/submit.sh train.sbatch`):
  Hydra composes it, each value of a sweep (`-m model=a,b`) on its own, then the checks a run
  makes before it builds anything (mandatory values, trainer / model / data fit, the schema) and
  the run directory's name;
- any other Hydra entry (`python -m analysis`, `python prepare.py`, ...: `hydra_entry("<config>")`
  in its source): composed, mandatory values set;
- an argparse entry (`python -m bench`, `bash slurm/paper.sh`, ...): its own parser reads the
  arguments, and the command stops there;
- `python -m laplace.export`: exports a tiny checkpoint for real;
- `bash FILE`: FILE exists and bash parses it; `pip install -e ".[x]"`: the extra exists.
Placeholders (`<run>`) stand for the folder of one tiny run trained for the test. A README command of another kind
fails the test: add its kind here rather than leave it unchecked. docs/ pages get the same checks
for the commands of these kinds (shell commands such as `hf download` or `tar` are left out).
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from conftest import ROOT, train_tiny_vit

README = ROOT / "README.md"
# the manual's pages whose commands this test checks (docs/LOG.md, the generated recipe cards and
# reports are records, not instructions)
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in {"LOG.md", "gpu_runs.md"})
PLACEHOLDER = re.compile(r"<[A-Za-z0-9_.-]+>")
# programs of a docs/ shell line that are not ours (a download, an archive): not checked
EXTERNAL = {"hf", "wget", "tar", "cd", "mkdir", "unzip", "sha1sum", "source", "scancel", "sbatch", "wandb",
            "torchrun", "for", "done", "(cd", "export", "lm_eval"}


# Why a SystemExit: the entry points run inside laplace.errors.cli_errors, which treats any other
# exception as a bug (traceback, then a hard exit of the process) but passes a status-0 exit on.
class Parsed(SystemExit):
    """Raised by argparse once a command's arguments are read: the command stops there (a
    SystemExit of status 0, which the entry points' error handling passes on)."""

    def __init__(self, namespace: argparse.Namespace):
        super().__init__(0)
        self.namespace = namespace


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def shell_commands(text: str, inline: bool = False) -> list[list[str]]:
    """The commands of the ```bash blocks, one argv each, trailing comments dropped; `inline`: also
    those quoted in the prose (`python ...`, `bash ...`: in the README each is a whole command)."""
    # a trailing backslash continues a command on the next line, as in a shell
    lines = [ln for block in code_blocks(text, "bash") for ln in block.replace("\\\n", " ").splitlines()]
    if inline:
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        lines += re.findall(r"`((?:python|bash) [^`]+)`", prose)
    # shlex splits as bash does: quotes kept together ('checkpoint={1}/...'), `# ...` dropped
    return [argv for argv in (shlex.split(ln, comments=True) for ln in lines) if argv]


def failures(commands: list[list[str]], ctx, strict: bool) -> list[str]:
    """'<command>: <why>' for each command that fails its check (or, strict, is of an unknown kind)."""
    failed = []  # every failing command named at once, not the first one alone
    for argv in commands:
        try:
            if not check_command(argv, ctx) and strict:
                failed.append(f"{' '.join(argv)}: a kind of command this test cannot check (add it here)")
        except (Exception, SystemExit) as e:
            failed.append(f"{' '.join(argv)}: {type(e).__name__}: {e}")
    return failed


def compose(config_name: str, overrides: list[str]):
    # the recipe cards' composition: Hydra's compose API on configs/, the zoo's model source included
    from train.recipe import compose_config

    return compose_config(overrides, config_name)


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """One override list per value of each sweep (`k=a,b`: [.., k=a, ..] and [.., k=b, ..]; other
    sweeps at their first value): every value is composed, without the product of all."""
    # Hydra's compose refuses a sweep value ("a,b"); its own parser says which overrides sweep
    parsed = OverridesParser.create().parse_overrides(overrides)
    first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override() else raw
             for o, raw in zip(parsed, overrides)]
    runs = [first]
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            runs += [first[:i] + [f"{o.get_key_element()}={v}"] + first[i + 1:] for v in o.sweep_string_iterator()]
    return runs


def check_train(overrides: list[str]) -> None:
    from train import check_engine_config, get_trainer, run_dir_from_overrides

    overrides = [o for o in overrides if o not in ("-m", "--multirun")]
    if "--cfg" in overrides:  # --cfg job|hydra|all: Hydra prints the config instead of running
        i = overrides.index("--cfg")
        overrides = overrides[:i] + overrides[i + 2:]
    for run in expand_sweeps(overrides):
        cfg = compose("config", run)
        # the checks a run makes first (mandatory values, fit, the schema), then the folder train.py
        # names from its task overrides (hydra/launcher=... is Hydra's own)
        check_engine_config(get_trainer(cfg.trainer.name), cfg)
        run_dir_from_overrides(cfg, [o for o in run if not o.startswith("hydra/")])


def entry_source(target: str) -> tuple[Path, str | None]:
    """(source file, module name) of `python FILE` or `python -m MODULE` (a package: its __main__)."""
    if target.endswith(".py"):
        assert (ROOT / target).is_file(), f"no file {target}"
        return ROOT / target, None
    spec = importlib.util.find_spec(target)
    assert spec is not None, f"no module {target}"
    if spec.submodule_search_locations:
        spec = importlib.util.find_spec(f"{target}.__main__")
        assert spec is not None, f"python -m {target}: the package has no __main__"
    return Path(spec.origin), target


def check_argparse(path: Path, module: str | None, args: list[str], monkeypatch) -> argparse.Namespace:
    """Run the entry as `python` runs it until its parser has read `args` (a bad argument: SystemExit 2)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, a=None, namespace=None):
        raise Parsed(original(self, a, namespace))

    # in this process rather than `python ... --help`: one import of torch for every command, and
    # the arguments themselves are read (a --help would not look at them)
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(sys, "argv", [str(path), *args])
        with pytest.raises(Parsed) as parsed:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(path), run_name="__main__")
    return parsed.value.namespace


def check_python(argv: list[str], ctx) -> None:
    if argv[0] == "-c":  # python -c CODE: it compiles
        compile(argv[1], "<python -c>", "exec")
        return
    if argv[0] == "-m":
        target, args = argv[1], argv[2:]
    else:
        target, args = argv[0], argv[1:]
    if target == "train.py":
        return check_train(args)
    if target == "train.launch":  # its flags, then the command it starts on every rank
        head = next(i for i, a in enumerate(args) if not a.startswith("--"))
        check_argparse(*entry_source(target), args, ctx.monkeypatch)
        return check_python(args[head:], ctx)
    if target == "laplace.export":  # key=value arguments without a parser: run it on the tiny run
        from laplace.export import main

        out = main(args)
        assert (out / "model.safetensors").is_file()
        return
    path, module = entry_source(target)
    # a Hydra entry names its config in its decorator: the source says which one, without importing it
    entry = re.search(r'hydra_entry\("(\w+)"\)', path.read_text())
    if entry:
        from train.config import check_required

        for run in expand_sweeps(args):
            check_required(compose(entry[1], run))
        return
    ns = check_argparse(path, module, args, ctx.monkeypatch)
    if target == "train.recipe":  # its positional arguments are train.py's overrides
        check_train(ns.overrides)


def check_bash(argv: list[str], ctx) -> None:
    script, args = argv[0], argv[1:]
    assert (ROOT / script).is_file(), f"no file {script}"
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True, timeout=60)  # parses, runs nothing
    if script == "slurm/paper.sh":  # exec python scripts/paper_runs.py "$@"
        check_argparse(ROOT / "scripts" / "paper_runs.py", None, args, ctx.monkeypatch)
    elif script == "slurm/submit.sh":  # sbatch flags, a script of slurm/, the script's arguments
        head = next(i for i, a in enumerate(args) if not a.startswith("-"))
        sbatch, rest = args[head], args[head + 1:]
        assert (ROOT / "slurm" / sbatch).is_file(), f"no slurm/{sbatch}"
        if sbatch == "train.sbatch":
            check_train(rest)
        elif sbatch == "run.sbatch":
            check_command(rest, ctx)
        elif sbatch == "analysis.sbatch":
            check_python(["-m", "analysis", *rest], ctx)


def check_pip(argv: list[str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for a in argv:
        if a.startswith(".["):
            for extra in a[2:-1].split(","):
                assert extra in extras, f"pip install: no extra [{extra}] in pyproject.toml"


def check_command(argv: list[str], ctx) -> bool:
    """Check one command; False when it is of a kind this test does not know."""
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value before the program
        argv = argv[1:]
    # <run> and friends become a real run folder: a command that reads it (an export) finds one
    argv = [PLACEHOLDER.sub(str(ctx.run), a) for a in argv]
    program, rest = argv[0], argv[1:]
    if program == "python":
        check_python(rest, ctx)
    elif program == "bash":
        check_bash(rest, ctx)
    elif program == "pip":
        check_pip(rest)
    else:
        return False
    return True


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny trained ViT run folder (2 blocks, 2 steps): what `<run>` stands for."""
    tmp = tmp_path_factory.mktemp("readme")
    with warnings.catch_warnings():  # 2 steps never leave the warm-up: the schedule says so
        warnings.simplefilter("ignore", UserWarning)
        return train_tiny_vit(tmp, "vitt_3L").parent.parent


@pytest.fixture
def ctx(tiny_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a command writes (an export) lands here
    monkeypatch.setenv("LAPLACE_RUNS", str(tmp_path / "runs"))

    def fail(status: int):  # a command's error ends the test, not the test process
        raise AssertionError(f"the command exited with status {status} (its error: above, in stderr)")

    monkeypatch.setattr("laplace.errors.hard_exit", fail)
    return type("Ctx", (), {"run": tiny_run, "monkeypatch": monkeypatch})


def test_the_readme_is_a_door_of_at_most_300_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: the manual belongs in docs/"


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy of an imported module
def test_every_command_of_the_readme_runs(ctx):
    commands = shell_commands(README.read_text(), inline=True)
    assert len(commands) >= 10
    failed = failures(commands, ctx, strict=True)
    assert not failed, "\n".join(failed)


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_command_of_the_manual_runs(page, ctx):
    commands = [argv for argv in shell_commands(page.read_text()) if argv[0] not in EXTERNAL]
    failed = failures(commands, ctx, strict=True)
    assert not failed, "\n".join(failed)


def test_the_readme_python_block_runs_after_its_training_command(tmp_path, monkeypatch):
    """The library block as a user pastes it, after the README command that makes the run it loads
    (trained here at tiny size into the folder that command names)."""
    from train import run, run_dir_from_overrides

    from conftest import TINY_VIT

    (block,) = [b for b in code_blocks(README.read_text(), "python") if "import laplace" in b]
    loads = Path(re.search(r'load_model\("([^"]+)"\)', block)[1]).parent.parent
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LAPLACE_RUNS", raising=False)  # runs/ as a user's checkout has it
    # the single trainings (a multirun makes no one folder; a <run> placeholder is the user's to fill)
    trains = [argv[2:] for argv in shell_commands(README.read_text())
              if argv[:2] == ["python", "train.py"] and "-m" not in argv and "<" not in " ".join(argv)]
    made = [o for o in trains if Path(run_dir_from_overrides(compose("config", o), o)) == loads]
    assert made, f"no `python train.py` command of README.md makes {loads}, which its Python block loads"
    cfg = compose("config", [*made[0], *TINY_VIT, "trainer.max_steps=2"])
    cfg.run_dir = str(loads)
    with warnings.catch_warnings():  # 2 steps never leave the warm-up: the schedule says so
        warnings.simplefilter("ignore", UserWarning)
        run(cfg)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert {"blocks.0", "norm"} <= set(scope["feats"]) and scope["model"].num_classes == 10


def anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces -> '-'."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_links_point_at_files_and_headings_that_exist(page):
    missing = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path = page.parent / target if target else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            missing.append(f"{target}#{anchor}" if anchor else target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files or headings: {missing}"


def test_the_console_scripts_the_readme_names_exist():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    named = set(re.findall(r"`(laplace-[a-z-]+)`", README.read_text()))
    assert named <= set(scripts), named - set(scripts)
