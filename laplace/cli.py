"""The Hydra entry point of every command line (train.py, eval.*, analysis.*).

    @hydra_entry("knn")              # configs/knn.yaml
    def main(cfg): ...
    if __name__ == "__main__":
        main()

One place finds configs/ (`config_dir`): a path relative to the calling file, Hydra's usual
`config_path="../configs"`, points into site-packages after a non-editable install, where
there is no configs/.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from .errors import UserError, cli_errors

CONFIG_DIR_ENV = "LAPLACE_CONFIG_DIR"


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
    """Make `fn(cfg)` a command line on configs/<config_name>.yaml: the zoo's `model/<name>`
    nodes are registered first, and `fn` runs inside `cli_errors` (bad input, a `???` left
    unset included: one `error:` line; a bug: its traceback; every failure exits at once),
    inside Hydra's task function so that no error reaches Hydra's own handler."""

    def decorate(fn):
        @functools.wraps(fn)
        def main():
            import hydra

            from .config import register_model_configs

            path = cli_errors(config_dir)(config_name)
            cli_errors(register_model_configs)()
            # the wrappers keep fn's name, module and file (functools.wraps): Hydra names the job after them
            task = cli_errors(_required(fn))
            return hydra.main(version_base="1.3", config_path=str(path), config_name=config_name)(task)()

        return main

    return decorate


def _required(fn):
    """A mandatory value (`???`) left unset, as one line naming the key."""
    from omegaconf.errors import MissingMandatoryValue

    @functools.wraps(fn)
    def wrapped(cfg):
        try:
            return fn(cfg)
        except MissingMandatoryValue as e:
            from .config import required_error

            raise required_error(e.full_key) from None

    return wrapped
