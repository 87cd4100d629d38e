"""The Hydra entry point of every command line (train.py, eval.*, analysis.*).

    @hydra_entry("knn")              # configs/knn.yaml
    def main(cfg): ...
    if __name__ == "__main__":
        main()

One place finds configs/ (`config_dir`): a path relative to the calling file, Hydra's usual
`config_path="../configs"`, points into site-packages after a non-editable install, where
there is no configs/.

The console scripts (`laplace-train`, `laplace-knn`, ...; pyproject's [project.scripts]) are
`COMMANDS`: each runs the checkout's `python train.py` / `python -m eval.knn` as those run
(`runpy`, same argv, same `__main__`), so a console script and the README's command line are one
program. Only `laplace` is installed as a package (pyproject says why); the commands' modules
(train/, eval/, analysis/, bench/) are read from the checkout, as configs/ is.
"""
from __future__ import annotations

import functools
import os
import runpy
import sys
from pathlib import Path

from .errors import UserError, cli_errors

CONFIG_DIR_ENV = "LAPLACE_CONFIG_DIR"

# console script -> what it runs: a file of the checkout (`python train.py`) or a module
# (`python -m eval.knn`). laplace-export (laplace.export:main) is a function of the package itself.
COMMANDS = {
    "laplace-train": "train.py",
    "laplace-launch": "-m train.launch",
    "laplace-recipe": "-m train.recipe",
    "laplace-prepare": "prepare.py",
    "laplace-knn": "-m eval.knn",
    "laplace-linear": "-m eval.linear",
    "laplace-segmentation": "-m eval.segmentation",
    "laplace-generate": "-m eval.generate",
    "laplace-lm-eval": "-m eval.lm",
    "laplace-lm-harness": "-m eval.lm_adapter",
    "laplace-analysis": "-m analysis",
    "laplace-tables": "-m analysis.tables",
    "laplace-figures": "-m analysis.figures",
    "laplace-bench": "-m bench",
}


def config_dir(config_name: str = "config") -> Path:
    """The configs/ folder holding `<config_name>.yaml`: $LAPLACE_CONFIG_DIR when set, else the
    checkout's configs/ beside the laplace package, else ./configs."""
    env = os.environ.get(CONFIG_DIR_ENV)
    places = [Path(env)] if env else [Path(__file__).resolve().parent.parent / "configs", Path.cwd() / "configs"]
    for place in places:
        if (place / f"{config_name}.yaml").is_file():
            return place.resolve()
    where = f"{CONFIG_DIR_ENV}={env}" if env else " or ".join(str(p) for p in places)
    raise UserError(f"no {config_name}.yaml in {where}: the commands read the repository's configs/ folder; "
                    f"run from a checkout (pip install -e .) or set {CONFIG_DIR_ENV}=<checkout>/configs")


def hydra_entry(config_name: str):
    """Make `fn(cfg)` a command line on configs/<config_name>.yaml: `fn` runs inside `cli_errors`
    (bad input, a `???` left unset included: one `error:` line; a bug: its traceback; every
    failure exits at once), inside Hydra's task function so that no error reaches Hydra's own handler."""

    def decorate(fn):
        user = {}  # the user's HYDRA_FULL_ERROR, read when the command starts

        @functools.wraps(fn)  # fn's name, module and file: Hydra names the job after them
        def task(cfg):
            from omegaconf.errors import MissingMandatoryValue

            _set_env("HYDRA_FULL_ERROR", user["value"])  # the task's own processes inherit the user's
            try:
                return fn(cfg)
            except MissingMandatoryValue as e:  # a `???` left unset: one line naming the key
                from .config import required_error

                raise required_error(e.full_key) from None

        @functools.wraps(fn)
        def main():
            import hydra

            path = cli_errors(config_dir)(config_name)
            # Hydra prints its own errors (an unknown key, a bad override, a model the zoo cannot
            # build) in several lines; with HYDRA_FULL_ERROR set it raises them, and they become one.
            user["value"] = os.environ.get("HYDRA_FULL_ERROR")
            os.environ["HYDRA_FULL_ERROR"] = "1"
            run = hydra.main(version_base="1.3", config_path=str(path), config_name=config_name)(cli_errors(task))
            return cli_errors(_hydra_errors(run, user["value"]))()

        return main

    return decorate


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _hydra_errors(run, user_setting):
    """`run` with Hydra's composition errors as one-line UserErrors (a list of options joined)."""
    from hydra.errors import HydraException

    def wrapped():
        try:
            return run()
        except HydraException as e:
            _set_env("HYDRA_FULL_ERROR", user_setting)
            if user_setting == "1":  # the user asked for Hydra's own report
                raise
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            starts = [i for i, ln in enumerate(lines) if ln.startswith("Available options")]
            if starts:  # a group's options, one a line: joined, without Hydra's search path
                options = [ln for ln in lines[starts[0] + 1:] if not ln.startswith(("Config search path", "provider="))]
                raise UserError(f"{lines[0]}; choose one of: {', '.join(options)}") from None
            raise UserError(" ".join(lines[:2]) or type(e).__name__) from None
        finally:
            _set_env("HYDRA_FULL_ERROR", user_setting)

    return wrapped


def checkout() -> Path:
    """The checkout whose train/, eval/, analysis/ and bench/ the commands run: the one the
    laplace package sits in (`pip install -e .`), else the working directory."""
    # train/ etc. are not installed packages (pyproject says why): they are read from a checkout,
    # found by its train.py and train/ package
    for place in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (place / "train.py").is_file() and (place / "train" / "__init__.py").is_file():
            return place.resolve()
    raise UserError(f"the command lines run the repository's train/, eval/, analysis/ and bench/, which are not "
                    f"installed as packages: install the checkout editable (pip install -e <checkout>) or run "
                    f"from the checkout ({Path.cwd()} is none)")


def main() -> None:
    """Every console script (pyproject's [project.scripts] all name this function): run the command
    line of COMMANDS that the script's own name picks, as `python -m mod` (runpy.run_module, the
    module as __main__) or `python file.py` (runpy.run_path) runs it, with sys.argv[1:] as they are
    and the checkout first on sys.path, as `python` puts it there."""
    # pip's launcher sets argv[0] to the script's path (on Windows with .exe): its name is the command.
    name = Path(sys.argv[0]).name.removesuffix(".exe")
    if name not in COMMANDS:  # called by hand under another name: say what it serves
        raise SystemExit(f"error: {name} is not a laplace console script ({', '.join(COMMANDS)})")
    root = cli_errors(checkout)()
    target = COMMANDS[name]
    sys.path.insert(0, str(root))
    if target.startswith("-m "):
        runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
    else:
        sys.argv[0] = str(root / target)
        runpy.run_path(sys.argv[0], run_name="__main__")
