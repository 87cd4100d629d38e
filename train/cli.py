"""The Hydra entry point of every command line (train.py, eval.*, analysis.*).

    @hydra_entry("knn")              # configs/knn.yaml
    def main(cfg): ...
    if __name__ == "__main__":
        main()

One place finds configs/ (`config_dir`): a path relative to the calling file, Hydra's usual
`config_path="../configs"`, points into site-packages after a non-editable install, where
there is no configs/.

The console scripts (`laplace-train`, ...) run these command lines from the checkout: laplace/console.py.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import MissingMandatoryValue

from laplace.errors import UserError, cli_errors

CONFIG_DIR_ENV = "LAPLACE_CONFIG_DIR"
FULL_ERROR = "HYDRA_FULL_ERROR"


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
        def named(cfg):
            try:
                return fn(cfg)
            except MissingMandatoryValue as e:  # a `???` left unset: one line naming the key
                from .config import required_error

                raise required_error(e.full_key) from None

        @functools.wraps(fn)
        def main():
            import hydra

            path = cli_errors(config_dir)(config_name)
            user = os.environ.get(FULL_ERROR)

            @functools.wraps(fn)  # fn's name, module and file: Hydra names the job after them
            def task(cfg):
                _full_error(user)  # the task and its own processes see the user's setting
                try:
                    return cli_errors(named)(cfg)
                finally:
                    _full_error("1")

            run = hydra.main(version_base="1.3", config_path=str(path), config_name=config_name)(task)
            return cli_errors(_one_line(run, user))()

        return main

    return decorate


def _full_error(value: str | None):
    """Set HYDRA_FULL_ERROR to `value` (None: unset)."""
    if value is None:
        os.environ.pop(FULL_ERROR, None)
    else:
        os.environ[FULL_ERROR] = value


def _one_line(run, user: str | None):
    """`run` with Hydra's composition errors as one-line UserErrors (a list of options joined)."""

    def wrapped():
        # Hydra prints its own errors (an unknown key, a bad override, a model the zoo cannot
        # build) in several lines; with HYDRA_FULL_ERROR set it raises them, and they become one.
        _full_error("1")
        try:
            return run()
        except HydraException as e:
            if user == "1":  # the user asked for Hydra's own report
                raise
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            starts = [i for i, ln in enumerate(lines) if ln.startswith("Available options")]
            if starts:  # a group's options, one a line: joined, without Hydra's search path
                options = [ln for ln in lines[starts[0] + 1:] if not ln.startswith(("Config search path", "provider="))]
                raise UserError(f"{lines[0]}; choose one of: {', '.join(options)}") from None
            raise UserError(" ".join(lines[:2]) or type(e).__name__) from None
        finally:
            _full_error(user)

    return wrapped
