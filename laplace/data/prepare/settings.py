"""Settings pinning: what decides the shards' content is written to `<out>/.settings.json` before
the first shard, and a re-run into the same folder with other settings or a changed source is
refused rather than mixing shards."""
import json
from pathlib import Path

from omegaconf import OmegaConf

from laplace.errors import ConfigError
from laplace.io import atomic_write


def output_dir(cfg, default_name: str) -> Path:
    """out, or <data_dir>/<name> (default: a name of the source, so that a re-run finds its folder)."""
    # Here, not in the package's __init__: prepare.images needs it, and the package imports that.
    if cfg.out is not None:
        return Path(str(cfg.out)).expanduser()
    return Path(str(cfg.paths.data_dir)).expanduser() / (cfg.name or default_name)


def settings_of(cfg) -> dict:
    """What decides the shards' content: a re-run into the same folder must match it."""
    keys = ["source", "source_config", "split", "val_split", "text_column", "tokenizer",
            "docs_per_shard", "val_docs", "max_docs"]  # not num_workers, batch_docs, progress: same bytes
    if cfg.tokenizer == "bpe":  # what the trained BPE depends on
        keys += ["vocab_size", "tokenizer_train_chars", "tokenizer_doc_chars"]
    return {k: OmegaConf.to_container(cfg, resolve=True)[k] for k in keys}


def pin(out: Path, settings: dict, describe: str | None = None, record: bool = True) -> None:
    """Refuse to resume into `out` with settings or a source other than those its shards were made
    with (whole shards would be kept and mixed with new ones); else, with `record`, record these."""
    path = out / ".settings.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    change = None
    # A changed source first: its message says which files changed (the last file is val, so an
    # added file would turn the old validation file into training text).
    if "source_files" in old and old["source_files"] != settings.get("source_files"):
        change = _changes(old["source_files"] or [], settings.get("source_files") or [])
    elif "source_files" in settings and "source_files" not in old and (out / "meta.json").is_file():
        # Prepared before sources were pinned: its meta.json still names the files it split.
        was = json.loads((out / "meta.json").read_text()).get("source")
        change = f"was {was}, now {describe}" if was != describe else None
    if change:
        raise ConfigError(f"source={settings['source']} changed since out={out} was prepared from it "
                          f"({change}): its shards would mix old and new files and the validation "
                          f"file would become training text; prepare into another out= (or name=), "
                          f"or add rebuild=true to delete {out}'s shards and start again")
    for key, now in settings.items():
        if key in old and old[key] != now:
            now, was = (json.dumps(v) for v in (now, old[key]))  # null, as YAML says it
            raise ConfigError(f"out={out} holds shards made with {key}={was}, not {now}: set it back to "
                              f"resume, or write to another out=, or add rebuild=true")
    if record:
        atomic_write(path, json.dumps({**old, **settings}, indent=1).encode())


def _changes(old: list, new: list) -> str:
    """'shard_00003.parquet added, shard_00001.parquet changed' from two source fingerprints."""
    a, b = {n: rest for n, *rest in old}, {n: rest for n, *rest in new}
    return ", ".join([f"{n} added" for n in b if n not in a] + [f"{n} removed" for n in a if n not in b]
                     + [f"{n} changed" for n in a if n in b and a[n] != b[n]]) or "files renamed"


TEXT_OUTPUTS = ("train/shard_*.npy", "val/shard_*.npy", "tokenizer.json", "meta.json", ".settings.json")


def remove_outputs(out: Path, patterns: tuple[str, ...], everything: bool) -> None:
    """Delete the temp files a killed run left in `out` (atomic_write's `.<name>.*.tmp`), and
    with `everything` the outputs themselves (rebuild=true)."""
    for pattern in patterns:
        folder, name = (out / pattern).parent, Path(pattern).name
        # Never read (hidden, not *.npy), but they hold disk; one prepare per `out` at a time.
        for p in folder.glob(f".{name}.*.tmp"):
            p.unlink(missing_ok=True)
        if everything:
            for p in folder.glob(name):
                p.unlink(missing_ok=True)


def positive_int(cfg, key: str, allow_null: bool = False, allow_zero: bool = False) -> int | None:
    """cfg[key] as a positive (`allow_zero`: non-negative) integer, or None where `allow_null`;
    anything else is one line naming the key."""
    v = cfg[key]
    if v is None and allow_null:
        return None
    # Hydra reads 1e6 as a float and true as a bool: an integer-valued float passes, a bool not.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v \
            or int(v) < (0 if allow_zero else 1):
        what = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{key}={v} must be {what} integer{' or null' if allow_null else ''}")
    return int(v)
