"""The Hydra entry point of every command line (train.py, eval.*, analysis.*).

    @hydra_entry("knn")              # configs/knn.yaml
    def main(cfg): ...
    if __name__ == "__main__":
        main()

One place finds configs/ (`config_dir`): a path relative to the calling file, Hydra's usual
`config_path="../configs"`, points into site-packages after a non-editable install, where
there is no configs/.
"""
import contextlib
import functools
import os
from pathlib import Path

from laplace.errors import UserError, cli_errors

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
    """Make `fn(cfg)` a command line on configs/<config_name>.yaml: `fn` runs inside `cli_errors`
    (bad input, a `???` left unset included: one `error:` line; a bug: its traceback; every
    failure exits at once), inside Hydra's task function so that no error reaches Hydra's own handler."""

    def decorate(fn):
        def named(cfg):
            from omegaconf.errors import MissingMandatoryValue

            try:
                return fn(cfg)
            except MissingMandatoryValue as e:  # a `???` left unset: one line naming the key
                from .config import required_error

                raise required_error(e.full_key) from None

        @functools.wraps(fn)
        def main():
            import hydra

            path = cli_errors(config_dir)(config_name)
            user = os.environ.get("HYDRA_FULL_ERROR")

            @functools.wraps(fn)  # fn's name, module and file: Hydra names the job after them
            def task(cfg):
                with _env("HYDRA_FULL_ERROR", user):  # the task and its own processes see the user's setting
                    return cli_errors(named)(cfg)

            run = hydra.main(version_base="1.3", config_path=str(path), config_name=config_name)(task)
            return cli_errors(_hydra_errors(run, user))()

        return main

    return decorate


@contextlib.contextmanager
def _env(key: str, value: str | None):
    """os.environ[key] = value (None: unset) inside the block; as it was after it."""
    before = os.environ.pop(key, None)
    if value is not None:
        os.environ[key] = value
    try:
        yield
    finally:
        os.environ.pop(key, None)
        if before is not None:
            os.environ[key] = before


def _hydra_errors(run, user_setting):
    """`run` with Hydra's composition errors as one-line UserErrors (a list of options joined)."""
    from hydra.errors import HydraException

    def wrapped():
        try:
            # Hydra prints its own errors (an unknown key, a bad override, a model the zoo cannot
            # build) in several lines; with HYDRA_FULL_ERROR set it raises them, and they become one.
            with _env("HYDRA_FULL_ERROR", "1"):
                return run()
        except HydraException as e:
            if user_setting == "1":  # the user asked for Hydra's own report
                raise
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            starts = [i for i, ln in enumerate(lines) if ln.startswith("Available options")]
            if starts:  # a group's options, one a line: joined, without Hydra's search path
                options = [ln for ln in lines[starts[0] + 1:] if not ln.startswith(("Config search path", "provider="))]
                raise UserError(f"{lines[0]}; choose one of: {', '.join(options)}") from None
            raise UserError(" ".join(lines[:2]) or type(e).__name__) from None

    return wrapped
