"""`python -m laplace.data.prepare`: a text source -> a tokenizer and token shards for the GPT.

    python -m laplace.data.prepare source=pydoc vocab_size=4096          # built-in text, ~1 s
    python -m laplace.data.prepare source=/data/fineweb-edu-100b-shuffle name=fineweb_edu
    python -m laplace.data.prepare source=HuggingFaceFW/fineweb-edu source_config=sample-10BT \\
        name=fineweb_edu_10BT max_docs=2000000

Every default lives in configs/prepare.yaml. Sources:
  * `pydoc`: Python's help topics (laplace.data.text.pydoc_documents): the train topics make the
    train shards, the held-out topics the validation shard. About 450 k characters: give it a
    small vocabulary (vocab_size=4096; the default 65536 needs far more text).
  * a folder or glob of parquet files with a `text_column`, the layout of
    karpathy/fineweb-edu-100b-shuffle (shard_00000.parquet, ...). Files are taken in name order
    and, as in nanochat, the LAST one is the validation split. Files are streamed by row group.
  * anything else: `datasets.load_dataset(source, source_config, split=..., streaming=True)`, a
    hub id (HuggingFaceFW/fineweb-edu) or a local dataset folder. The validation documents come
    from `val_split`, or, when that is null, are the first `val_docs` documents of `split`
    (which the train shards then skip).

Output (in `out`, default ${paths.data_dir}/<name>, name default <source>_<tokenizer>):
    tokenizer.json           tokenizer=bpe: trained here on the first tokenizer_train_chars
                             characters of the training documents (each cut to
                             tokenizer_doc_chars, as nanochat does), or reused if it exists
    train/shard_00000.npy    token shards (laplace.data.shards.write_shard: uint16 when the
    ...                      vocabulary has <= 65536 ids), <|bos|> before every document
    val/shard_00000.npy      the first val_docs documents of the validation split
    meta.json                source, tokenizer spec, vocab_size, per-shard documents / tokens;
                             written last: its presence means the folder is complete

Determinism and resuming: train shard i holds exactly the training documents
[i * docs_per_shard, (i + 1) * docs_per_shard) in source order (the last one fewer), so each
shard is a function of the source and the settings alone. Shards are written atomically, one by
one; a re-run (after a kill, or to extend nothing) keeps the shards that exist, skips their
documents without tokenizing them (parquet: by the row counts in the file footers) and writes
the rest, byte-identical to an uninterrupted run. The hidden temp files a killed run leaves
(`.shard_*.npy.*.tmp`, ...) are never read, and the next run deletes them (one prepare per `out`
at a time). `.settings.json`, written before the first shard, pins the settings, the tokenizer's
fingerprint and the source (parquet: each file's name, size and row count): a re-run into the
same folder with other settings, or after the source changed (a file added: the old validation
file would become training text), is refused rather than mixing shards; `rebuild=true` deletes
the folder's shards and starts again. Memory is bounded by one shard (docs_per_shard documents),
whatever the dataset size.

Parallelism: `num_workers` threads tokenize each batch of documents (tiktoken runs without the
GIL), so throughput scales with cores; the end summary prints tokens/s and tokens/s per core.
"""
from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from laplace.data import DatasetNotFoundError
from laplace.data.shards import shard_dtype, write_shard
from laplace.errors import ConfigError, UserError, cli_errors
from laplace.io import atomic_write
from laplace.tokenizer import (
    MIN_VOCAB,
    Tokenizer,
    _cores,
    capped_texts,
    load_tokenizer,
    train_bpe,
)

META_VERSION = 1


class SourceError(UserError, ValueError):
    """A source file that cannot be read as text (corrupt, truncated, not UTF-8); names it."""


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.npy"


# ---------------------------------------------------------------------------------------------
# Sources: batches of documents (lists of str), the training documents from any start index.
# ---------------------------------------------------------------------------------------------

class PydocSource:
    """The built-in help topics (a few hundred kB, in memory)."""

    name = "pydoc"

    def __init__(self):
        from laplace.data.text import pydoc_documents

        self.train, self.val = pydoc_documents(True), pydoc_documents(False)
        self.num_train = len(self.train)

    def describe(self) -> str:
        return "pydoc"

    def fingerprint(self) -> list | None:
        return None  # fixed by the Python version, which settings do not pin

    def train_batches(self, start: int, batch: int) -> Iterator[list[str]]:
        for i in range(start, len(self.train), batch):
            yield self.train[i:i + batch]

    def val_batches(self, batch: int) -> Iterator[list[str]]:
        for i in range(0, len(self.val), batch):
            yield self.val[i:i + batch]


class ParquetSource:
    """Parquet files with a text column; the last file (in name order) is the validation split.

    Only the footers are read up front (row counts per row group, the schema): skipping to a
    document reads nothing before it, and documents are streamed by row group."""

    def __init__(self, files: list[Path], column: str, where: str):
        if len(files) < 2:
            raise ConfigError(f"source={where} holds {len(files)} parquet file; the last file is the "
                              f"validation split, so give a folder or glob with at least two")
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.column = column
        self.files, self.row_groups = files, []
        for f in files:
            try:
                meta = pq.ParquetFile(f).metadata
                schema = meta.schema.to_arrow_schema()
            except (pa.ArrowException, OSError) as e:
                raise _unreadable(f, e) from None
            if column not in schema.names:
                raise ConfigError(f"text_column={column}: {f} has no such column, it has "
                                  f"{schema.names}; set text_column to the one holding the text")
            kind = schema.field(column).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise SourceError(f"{f}: column {column!r} holds {kind}, not text; write it as a "
                                  f"UTF-8 string column, or set text_column to one")
            self.row_groups.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        self.name = Path(where.split("*")[0].rstrip("/")).name or "parquet"
        self.num_train = sum(sum(r) for r in self.row_groups[:-1])
        self._where = where

    def describe(self) -> str:
        return f"{self._where} ({len(self.files) - 1} train files + {self.files[-1].name} for val)"

    def fingerprint(self) -> list:
        """[name, bytes, rows] per file: what decides which documents are train and which val."""
        return [[f.name, f.stat().st_size, sum(r)] for f, r in zip(self.files, self.row_groups)]

    def _read(self, k: int, start: int, batch: int) -> Iterator[list[str]]:
        """Documents of file k from its row `start` on."""
        import pyarrow.parquet as pq

        g, skip = 0, start
        while g < len(self.row_groups[k]) and skip >= self.row_groups[k][g]:
            skip -= self.row_groups[k][g]
            g += 1
        if g == len(self.row_groups[k]):
            return
        import pyarrow as pa

        f, row = self.files[k], sum(self.row_groups[k][:g])
        try:
            pf = pq.ParquetFile(f)
            for rb in pf.iter_batches(batch_size=batch, row_groups=range(g, pf.num_row_groups),
                                      columns=[self.column]):
                docs = _texts(rb.column(0), f, self.column, row)
                row += len(docs)
                if skip:
                    docs, skip = docs[skip:], max(skip - len(docs), 0)
                if docs:
                    yield docs
        except (pa.ArrowException, OSError) as e:  # a damaged page: found only when read
            raise _unreadable(f, e, f" (near row {row})") from None

    def train_batches(self, start: int, batch: int) -> Iterator[list[str]]:
        for k in range(len(self.files) - 1):
            rows = sum(self.row_groups[k])
            if start >= rows:
                start -= rows
                continue
            yield from self._read(k, start, batch)
            start = 0

    def val_batches(self, batch: int) -> Iterator[list[str]]:
        yield from self._read(len(self.files) - 1, 0, batch)


def _texts(column, f: Path, name: str, first_row: int) -> list[str]:
    try:
        return [d if d is not None else "" for d in column.to_pylist()]
    except UnicodeDecodeError as e:
        bad = next(i for i in range(len(column)) if not _decodes(column, i))
        raise SourceError(f"{f}: row {first_row + bad} of column {name!r} is not valid UTF-8 "
                          f"({e.reason} at byte {e.start}); fix or drop that row, or remove "
                          f"the file from the source") from None


def _decodes(column, i: int) -> bool:
    try:
        column[i].as_py()
        return True
    except UnicodeDecodeError:
        return False


def _unreadable(f: Path, e: BaseException, where: str = "") -> SourceError:
    return SourceError(f"{f}{where} is not a readable parquet file ({type(e).__name__}: "
                       f"{_first_line(e)}); download it again or remove it from the source")


class HFSource:
    """A `datasets` dataset, streamed (hub id or local dataset folder)."""

    def __init__(self, source: str, config: str | None, split: str, val_split: str | None,
                 val_docs: int, column: str):
        self.source, self.config, self.split, self.val_split = source, config, split, val_split
        self.val_docs, self.column = val_docs, column
        self.name = Path(source.rstrip("/")).name + (f"_{config}" if config else "")
        self.num_train = None
        self._train = self._load(split)
        self._val = self._load(val_split) if val_split else None
        first = next(iter(self._train.take(1)), None)  # a wrong column fails now, not mid-run
        if first is not None and column not in first:
            raise self._no_column(list(first))

    def _no_column(self, columns: list[str]) -> ConfigError:
        return ConfigError(f"text_column={self.column}: {self.source} has no such column, it has "
                           f"{columns}; set text_column to the one holding the text")

    def fingerprint(self) -> list | None:
        return None  # a streamed dataset has no cheap one; source and split are pinned

    def describe(self) -> str:
        cfg = f" ({self.config})" if self.config else ""
        val = f"split {self.val_split}" if self.val_split else f"the first {self.val_docs} documents"
        return f"{self.source}{cfg} split {self.split}, val: {val}"

    def _load(self, split: str):
        import datasets

        try:
            return datasets.load_dataset(self.source, self.config, split=split, streaming=True)
        except (OSError, datasets.exceptions.DatasetNotFoundError) as e:  # incl. ConnectionError
            raise DatasetNotFoundError(
                f"source={self.source}: no such local path ({Path(self.source).absolute()}) and "
                f"`datasets` could not load it ({type(e).__name__}: {_first_line(e)}); set source "
                f"to pydoc, a parquet folder / glob, a local dataset folder or a reachable hub id"
            ) from None
        except ValueError as e:  # an unknown config or split name
            raise ConfigError(f"source={self.source} source_config={self.config} split={split}: "
                              f"{_first_line(e)}") from None

    def _batches(self, ds, batch: int) -> Iterator[list[str]]:
        docs = []
        for ex in ds:
            if self.column not in ex:
                raise self._no_column(list(ex))
            docs.append(ex[self.column] or "")
            if len(docs) == batch:
                yield docs
                docs = []
        if docs:
            yield docs

    def train_batches(self, start: int, batch: int) -> Iterator[list[str]]:
        skip = start + (0 if self._val is not None else self.val_docs)
        yield from self._batches(self._train.skip(skip) if skip else self._train, batch)

    def val_batches(self, batch: int) -> Iterator[list[str]]:
        yield from self._batches((self._val if self._val is not None else self._train)
                                 .take(self.val_docs), batch)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def open_source(cfg) -> PydocSource | ParquetSource | HFSource:
    """The source named by cfg.source (see the module docstring)."""
    source = str(cfg.source)
    if source == "pydoc":
        return PydocSource()
    where = os.path.expanduser(source)
    if glob.has_magic(where):
        files = sorted(Path(p) for p in glob.glob(where) if p.endswith(".parquet"))
        if not files:
            raise DatasetNotFoundError(f"no parquet files match source={source} (looked for "
                                       f"{os.path.abspath(where)}); set source to a folder or glob "
                                       f"of *.parquet files, pydoc, or a datasets hub id")
        return ParquetSource(files, cfg.text_column, source)
    if os.path.isfile(where) and where.endswith(".parquet"):
        return ParquetSource([Path(where)], cfg.text_column, source)
    if os.path.isdir(where):
        files = sorted(Path(where).glob("*.parquet"))
        if files:
            return ParquetSource(files, cfg.text_column, source)
    elif os.path.isabs(where) or source.startswith((".", "~")) or os.path.exists(where) \
            or source.endswith(".parquet") or source.count("/") > 1:
        # Clearly a path, and not there: do not ask the hub about it.
        raise DatasetNotFoundError(f"source={source} not found: looked for {os.path.abspath(where)}; "
                                   f"set source to a folder or glob of parquet files, pydoc, or a "
                                   f"datasets hub id (e.g. HuggingFaceFW/fineweb-edu)")
    return HFSource(source, cfg.source_config, cfg.split, cfg.val_split, int(cfg.val_docs),
                    cfg.text_column)


# ---------------------------------------------------------------------------------------------
# Tokenizing and writing
# ---------------------------------------------------------------------------------------------

def encode_docs(tok: Tokenizer, docs: list[str], dtype: np.dtype, threads: int) -> np.ndarray:
    """<|bos|> + the ids of each document, concatenated, as one array of `dtype`."""
    lists = tok.encode_batch(docs, prepend_bos=True, num_threads=threads)
    out = np.empty(sum(map(len, lists)), dtype=dtype)
    pos = 0
    for ids in lists:
        out[pos:pos + len(ids)] = ids
        pos += len(ids)
    return out


def _shard_tokens(path: Path) -> int | None:
    """Length of a finished shard (header only), None if missing or unreadable."""
    try:
        return len(np.load(path, mmap_mode="r"))
    except (OSError, ValueError):  # absent, or not a whole .npy: written again
        return None


def _count_docs(path: Path, bos_id: int) -> int:
    # Ordinary text never encodes to <|bos|>, so the BOS count is the document count.
    return int(np.count_nonzero(np.load(path, mmap_mode="r") == bos_id))


class _Progress:
    def __init__(self, enabled: bool, total: int | None, desc: str):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="doc", unit_scale=True, leave=False)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Stats:
    def __init__(self):
        self.docs = self.tokens = 0
        self.seconds = 0.0

    def encode(self, tok, docs, dtype, threads) -> np.ndarray:
        t = time.perf_counter()
        arr = encode_docs(tok, docs, dtype, threads)
        self.seconds += time.perf_counter() - t
        self.docs, self.tokens = self.docs + len(docs), self.tokens + len(arr)
        return arr


def write_train(src, tok: Tokenizer, folder: Path, docs_per_shard: int, max_docs: int | None,
                batch_docs: int, threads: int, stats: _Stats, progress: bool) -> list[dict]:
    """Train shards in `folder` (see the module docstring); returns [{file, docs, tokens}]."""
    D, dtype = docs_per_shard, shard_dtype(tok.vocab_size)
    limit = max_docs if max_docs is not None else float("inf")
    shards: list[dict] = []
    while (n := _shard_tokens(folder / shard_name(len(shards)))) is not None:
        shards.append({"file": f"{folder.name}/{shard_name(len(shards))}", "docs": D, "tokens": n})
    if shards:  # every shard but the last holds D documents: count only the last
        shards[-1]["docs"] = _count_docs(folder.parent / shards[-1]["file"], tok.bos_id)
        if shards[-1]["docs"] < D:
            return shards  # the source ran out in the last shard: finished
    start = len(shards) * D
    if start >= limit:
        return shards
    total = min(src.num_train, limit) if src.num_train is not None else (
        None if max_docs is None else max_docs)
    bar = _Progress(progress, total, "train docs")
    bar.update(start)
    parts, docs, seen = [], 0, start
    for batch in src.train_batches(start, batch_docs):
        batch = batch[:max(int(min(limit, seen + len(batch)) - seen), 0)]
        seen += len(batch)
        while batch:
            take = min(len(batch), D - docs)
            parts.append(stats.encode(tok, batch[:take], dtype, threads))
            docs, batch = docs + take, batch[take:]
            bar.update(take)
            if docs == D:
                shards.append(_flush(folder, len(shards), parts, docs, tok.vocab_size))
                parts, docs = [], 0
        if seen >= limit:
            break
    if docs:
        shards.append(_flush(folder, len(shards), parts, docs, tok.vocab_size))
    bar.close()
    return shards


def _flush(folder: Path, i: int, parts: list[np.ndarray], docs: int, vocab_size: int) -> dict:
    arr = np.concatenate(parts)
    write_shard(folder / shard_name(i), arr, vocab_size)
    return {"file": f"{folder.name}/{shard_name(i)}", "docs": docs, "tokens": len(arr)}


def write_val(src, tok: Tokenizer, folder: Path, val_docs: int, batch_docs: int, threads: int,
              stats: _Stats) -> list[dict]:
    """The validation shard: the first val_docs documents of the validation split."""
    path = folder / shard_name(0)
    if val_docs == 0:
        return []
    if (n := _shard_tokens(path)) is not None:
        return [{"file": f"{folder.name}/{path.name}", "docs": _count_docs(path, tok.bos_id), "tokens": n}]
    parts, docs = [], 0
    for batch in src.val_batches(batch_docs):
        batch = batch[:val_docs - docs]
        parts.append(stats.encode(tok, batch, shard_dtype(tok.vocab_size), threads))
        docs += len(batch)
        if docs >= val_docs:
            break
    if not docs:
        raise ConfigError(f"source={src.describe()} has no validation documents; give it a "
                          f"validation split (val_split) or set val_docs=0")
    return [_flush(folder, 0, parts, docs, tok.vocab_size)]


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

def _positive(cfg, key: str, allow_null: bool = False, allow_zero: bool = False) -> int | None:
    v = cfg[key]
    if v is None and allow_null:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v \
            or int(v) < (0 if allow_zero else 1):
        what = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{key}={v} must be {what} integer{' or null' if allow_null else ''}")
    return int(v)


def output_dir(cfg, src) -> Path:
    if cfg.out is not None:
        return Path(str(cfg.out)).expanduser()
    kind = cfg.tokenizer if cfg.tokenizer in ("bpe", "bytes", "gpt2") else "bpe"
    return Path(str(cfg.paths.data_dir)).expanduser() / (cfg.name or f"{src.name}_{kind}")


def make_tokenizer(cfg, out: Path, src, max_docs: int | None) -> Tokenizer:
    """tokenizer=bpe: out/tokenizer.json, trained here unless it exists; bytes | gpt2; or an
    existing file, copied to out/tokenizer.json so the folder is self-contained."""
    spec = str(cfg.tokenizer)
    path = out / "tokenizer.json"
    if spec in ("bytes", "gpt2"):
        return load_tokenizer(spec)
    if spec != "bpe":
        return load_tokenizer(spec)  # copied into out by prepare, once the settings are checked
    vocab = _positive(cfg, "vocab_size")
    if vocab <= MIN_VOCAB:
        raise ConfigError(f"vocab_size={vocab} must exceed {MIN_VOCAB} (256 bytes + 9 special "
                          f"tokens); the paper uses 65536, the built-in text 4096")
    if path.is_file():
        tok = load_tokenizer(path)
        if tok.vocab_size != vocab:
            raise ConfigError(f"vocab_size={vocab} but {path} (from an earlier run) has "
                              f"{tok.vocab_size}; set vocab_size={tok.vocab_size} or another out")
        return tok
    chars = _positive(cfg, "tokenizer_train_chars")
    doc_chars = _positive(cfg, "tokenizer_doc_chars")
    print(f"[prepare] training a BPE tokenizer (vocab {vocab:,}) on up to {chars:,} characters",
          flush=True)
    t = time.perf_counter()
    docs = (d for batch in src.train_batches(0, 1024) for d in batch)
    if max_docs is not None:
        docs = (d for _, d in zip(range(max_docs), docs))
    tok = train_bpe(capped_texts(docs, chars, doc_chars), vocab, path)
    print(f"[prepare] tokenizer trained in {time.perf_counter() - t:.1f} s -> {path}", flush=True)
    return load_tokenizer(path)


def _settings(cfg) -> dict:
    """What decides the shards' content: a re-run into the same folder must match it."""
    keys = ["source", "source_config", "split", "val_split", "text_column", "tokenizer",
            "docs_per_shard", "val_docs", "max_docs"]
    if cfg.tokenizer == "bpe":
        keys += ["vocab_size", "tokenizer_train_chars", "tokenizer_doc_chars"]
    return {k: OmegaConf.to_container(cfg, resolve=True)[k] for k in keys}


def _check_settings(out: Path, settings: dict, describe: str) -> None:
    path = out / ".settings.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    change = None
    if "source_files" in old and old["source_files"] != settings["source_files"]:
        change = _changes(old["source_files"], settings["source_files"])
    elif "source_files" not in old and (out / "meta.json").is_file():
        # Prepared before sources were pinned: its meta.json still names the files it split.
        was = json.loads((out / "meta.json").read_text()).get("source")
        change = f"was {was}, now {describe}" if was != describe else None
    if change:
        raise ConfigError(f"source={settings['source']} changed since out={out} was prepared from it "
                          f"({change}): its shards would mix old and new files and the validation "
                          f"file would become training text; prepare into another out= (or name=), "
                          f"or add rebuild=true to delete {out}'s shards and start again")
    for k, v in settings.items():
        if k in old and old[k] != v:
            raise ConfigError(f"{k}={v}, but out={out} holds shards made with {k}={old[k]}; set "
                              f"{k}={old[k]} to resume, or out= to another folder (or delete it)")


def _changes(old: list, new: list) -> str:
    """'shard_00003.parquet added, shard_00001.parquet changed' from two source fingerprints."""
    a, b = {n: rest for n, *rest in old}, {n: rest for n, *rest in new}
    return ", ".join([f"{n} added" for n in b if n not in a] + [f"{n} removed" for n in a if n not in b]
                     + [f"{n} changed" for n in a if n in b and a[n] != b[n]]) or "files renamed"


_OUTPUTS = ("train/shard_*.npy", "val/shard_*.npy", "tokenizer.json", "meta.json", ".settings.json")


def _remove_outputs(out: Path, everything: bool) -> None:
    """Delete the temp files a killed run left in `out` (atomic_write's `.<name>.*.tmp`), and
    with `everything` the outputs themselves (rebuild=true)."""
    for pattern in _OUTPUTS:
        folder, name = (out / pattern).parent, Path(pattern).name
        for p in folder.glob(f".{name}.*.tmp"):
            p.unlink(missing_ok=True)
        if everything:
            for p in folder.glob(name):
                p.unlink(missing_ok=True)


def prepare(cfg: DictConfig) -> dict:
    """Write the tokenizer, shards and meta.json of cfg (configs/prepare.yaml); returns the meta."""
    if OmegaConf.is_missing(cfg, "source"):
        raise ConfigError("source is required: source=pydoc | a parquet folder or glob | a "
                          "datasets hub id (e.g. source=pydoc vocab_size=4096)")
    docs_per_shard = _positive(cfg, "docs_per_shard")
    val_docs = _positive(cfg, "val_docs", allow_zero=True)
    max_docs = _positive(cfg, "max_docs", allow_null=True)
    batch_docs = _positive(cfg, "batch_docs")
    threads = _positive(cfg, "num_workers", allow_null=True) or _cores()
    cores = min(threads, _cores())
    t0 = time.perf_counter()

    src = open_source(cfg)
    out = output_dir(cfg, src)
    settings = {**_settings(cfg), "source_files": src.fingerprint()}
    _remove_outputs(out, everything=bool(cfg.get("rebuild")))
    _check_settings(out, settings, src.describe())
    tok = make_tokenizer(cfg, out, src, max_docs)
    settings["tokenizer_fingerprint"] = tok.fingerprint()
    _check_settings(out, settings, src.describe())
    if tok.kind == "bpe" and Path(tok.spec) != (out / "tokenizer.json").absolute():
        tok.save(out / "tokenizer.json")
        tok = load_tokenizer(out / "tokenizer.json")
    atomic_write(out / ".settings.json", json.dumps(settings, indent=1).encode())

    print(f"[prepare] {src.describe()} -> {out} ({tok.kind} tokenizer, vocab {tok.vocab_size:,}, "
          f"{threads} threads)", flush=True)
    stats = _Stats()
    train = write_train(src, tok, out / "train", docs_per_shard, max_docs, batch_docs, threads,
                        stats, bool(cfg.progress))
    if not train:
        raise ConfigError(f"source={cfg.source} gave no training documents ({src.describe()}, "
                          f"max_docs={max_docs}); check source, split, val_split and val_docs")
    val = write_val(src, tok, out / "val", val_docs, batch_docs, threads, stats)

    meta = {"version": META_VERSION, "source": src.describe(), "settings": settings,
            "tokenizer": tok.spec, "tokenizer_kind": tok.kind, "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id, "dtype": shard_dtype(tok.vocab_size).name,
            "train": {"docs": sum(s["docs"] for s in train),
                      "tokens": sum(s["tokens"] for s in train), "shards": train},
            "val": {"docs": sum(s["docs"] for s in val),
                    "tokens": sum(s["tokens"] for s in val), "shards": val}}
    atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode())

    tr, va = meta["train"], meta["val"]
    print(f"[prepare] train: {tr['docs']:,} documents, {tr['tokens']:,} tokens in "
          f"{len(train)} shards; val: {va['docs']:,} documents, {va['tokens']:,} tokens", flush=True)
    if stats.tokens:
        tps = stats.tokens / max(stats.seconds, 1e-9)
        print(f"[prepare] tokenized {stats.docs:,} documents, {stats.tokens:,} tokens in "
              f"{stats.seconds:.1f} s: {tps:,.0f} tokens/s, {tps / cores:,.0f} tokens/s per "
              f"core ({threads} threads on {cores} cores); total {time.perf_counter() - t0:.1f} s", flush=True)
    else:
        print("[prepare] all shards existed: nothing tokenized", flush=True)
    print(f"[prepare] wrote {out / 'meta.json'}", flush=True)
    return meta


@hydra.main(version_base="1.3", config_path="../../configs", config_name="prepare")
def main(cfg: DictConfig) -> None:
    # Bad input: one `error:` line (HYDRA_FULL_ERROR=1: traceback); a bug: its traceback.
    cli_errors(prepare)(cfg)


if __name__ == "__main__":
    main()
