"""The console scripts (`laplace-train`, `laplace-knn`, ...; pyproject's [project.scripts]): each
runs the checkout's `python train.py` / `python -m eval.knn` as those run (`runpy`, same argv, same
`__main__`), so a console script and the README's command line are one program.

Only `laplace` is installed as a package (pyproject says why): the commands' modules (train/,
eval/, analysis/, bench/) are read from the checkout, as configs/ is. This launcher is the one
piece of the command lines that lives in the package, because the installed scripts must import it.
"""
import runpy
import sys
from pathlib import Path

from .errors import UserError, cli_errors

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
