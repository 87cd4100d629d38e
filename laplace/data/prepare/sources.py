"""Text sources of `prepare`: batches of documents (lists of str), the training documents from any
start index. `pydoc` and `stdlib` (built in), parquet files (the last one = validation) or a `datasets`
dataset, streamed (docs/text_data.md)."""
import glob
import os
from collections.abc import Iterator
from pathlib import Path

from laplace.data import DatasetNotFoundError
from laplace.errors import ConfigError, UserError, one_line


class SourceError(UserError, ValueError):
    """A source file that cannot be read as text (corrupt, truncated, not UTF-8); names it."""


class BuiltinSource:
    """Text found on every machine, in memory: `pydoc`, Python's help topics (a few hundred kB),
    or `stdlib`, Python's standard-library sources (~31 M characters; laplace.data.text)."""

    def __init__(self, name: str):
        from laplace.data import text

        # In memory: the whole text is small enough (at most ~31 M characters).
        documents, self.layout = {"pydoc": (text.pydoc_documents, None),
                                  "stdlib": (text.stdlib_documents, text.STDLIB_LAYOUT)}[name]
        self.name = name
        self.train, self.val = documents(True), documents(False)
        self.num_train = len(self.train)

    def describe(self) -> str:
        return self.name

    def fingerprint(self) -> list | None:
        # The texts are fixed by the Python version, which settings do not pin; a layout (how the
        # texts become documents, in which order) is, so that shards of another layout are refused.
        return [[self.layout]] if self.layout else None

    def train_batches(self, start: int, batch: int) -> Iterator[list[str]]:
        return (self.train[i:i + batch] for i in range(start, len(self.train), batch))

    def val_batches(self, batch: int) -> Iterator[list[str]]:
        return (self.val[i:i + batch] for i in range(0, len(self.val), batch))


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
        # Every file checked now (footer, column, type): a bad one stops the run before the first
        # shard, with its name, rather than hours later.
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
        # out's default folder name: the folder the files (or the glob) are in
        self.name = Path(where.split("*")[0].rstrip("/")).name or "parquet"
        self.num_train = sum(sum(r) for r in self.row_groups[:-1])
        self._where = where

    def describe(self) -> str:
        return f"{self._where} ({len(self.files) - 1} train files + {self.files[-1].name} for val)"

    def fingerprint(self) -> list:
        """[name, bytes, rows] per file: what decides which documents are train and which val."""
        # A file added, removed or rewritten would move documents between train and val (the
        # last file is val): prepare refuses to resume into shards made from other files.
        return [[f.name, f.stat().st_size, sum(r)] for f, r in zip(self.files, self.row_groups)]

    def _read(self, k: int, start: int, batch: int) -> Iterator[list[str]]:
        """Documents of file k from its row `start` on."""
        import pyarrow.parquet as pq

        # Skip whole row groups by the footer's counts (a resumed run reads nothing before its
        # first document), then the first `skip` rows of the group it starts in.
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
        # Training document `start` is in the first file whose rows do not all come before it.
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
    """The documents of a string column; a null document is empty."""
    import pyarrow as pa

    docs = []
    # As bytes, decoded here: pyarrow's own decode error names neither file nor row.
    kind = pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
    for raw in column.view(kind).to_pylist():
        try:
            docs.append("" if raw is None else raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise SourceError(f"{f}: row {first_row + len(docs)} of column {name!r} is not valid UTF-8 "
                              f"({e.reason} at byte {e.start}); fix or drop that row, or remove "
                              f"the file from the source") from None
    return docs


def _unreadable(f: Path, e: BaseException, where: str = "") -> SourceError:
    return SourceError(f"{f}{where} is not a readable parquet file ({type(e).__name__}: "
                       f"{one_line(e)[:300]}); download it again or remove it from the source")


class HFSource:
    """A `datasets` dataset, streamed (hub id or local dataset folder)."""

    def __init__(self, source: str, config: str | None, split: str, val_split: str | None,
                 val_docs: int, column: str):
        self.source, self.config, self.split, self.val_split = source, config, split, val_split
        self.val_docs, self.column = val_docs, column
        self.name = Path(source.rstrip("/")).name + (f"_{config}" if config else "")
        self.num_train = None  # unknown: the dataset is streamed
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
                f"`datasets` could not load it ({type(e).__name__}: {one_line(e)[:300]}); set source "
                f"to pydoc, a parquet folder / glob, a local dataset folder or a reachable hub id"
            ) from None
        except ValueError as e:  # an unknown config or split name
            raise ConfigError(f"source={self.source} source_config={self.config} split={split}: "
                              f"{one_line(e)[:300]}") from None

    def _batches(self, ds, batch: int) -> Iterator[list[str]]:
        for rows in ds.iter(batch_size=batch):  # columns -> lists of `batch` values, the last fewer
            if self.column not in rows:
                raise self._no_column(list(rows))
            yield [d or "" for d in rows[self.column]]

    def train_batches(self, start: int, batch: int) -> Iterator[list[str]]:
        # Without a validation split the first val_docs documents are the validation ones.
        # Streamed: a resumed run reads through the `start` documents it skips (not tokenized).
        skip = start + (0 if self._val is not None else self.val_docs)
        yield from self._batches(self._train.skip(skip) if skip else self._train, batch)

    def val_batches(self, batch: int) -> Iterator[list[str]]:
        yield from self._batches((self._val if self._val is not None else self._train)
                                 .take(self.val_docs), batch)


def open_source(cfg) -> BuiltinSource | ParquetSource | HFSource:
    """The source named by cfg.source (docs/text_data.md)."""
    source = str(cfg.source)
    if source in ("pydoc", "stdlib"):
        return BuiltinSource(source)
    where = os.path.expanduser(source)
    if glob.has_magic(where):
        files = sorted(Path(p) for p in glob.glob(where) if p.endswith(".parquet"))
        if not files:
            raise DatasetNotFoundError(f"no parquet files match source={source} (looked for "
                                       f"{os.path.abspath(where)}); set source to a folder or glob "
                                       f"of *.parquet files, pydoc, stdlib, or a datasets hub id")
        return ParquetSource(files, cfg.text_column, source)
    if os.path.isfile(where) and where.endswith(".parquet"):  # refused by ParquetSource: no val file
        return ParquetSource([Path(where)], cfg.text_column, source)
    if os.path.isdir(where):
        files = sorted(Path(where).glob("*.parquet"))
        if files:
            return ParquetSource(files, cfg.text_column, source)
    elif os.path.isabs(where) or source.startswith((".", "~")) or os.path.exists(where) \
            or source.endswith(".parquet") or source.count("/") > 1:
        # Clearly a path, and not there: do not ask the hub about it.
        raise DatasetNotFoundError(f"source={source} not found: looked for {os.path.abspath(where)}; "
                                   f"set source to a folder or glob of parquet files, pydoc, stdlib, or a "
                                   f"datasets hub id (e.g. HuggingFaceFW/fineweb-edu)")
    return HFSource(source, cfg.source_config, cfg.split, cfg.val_split, int(cfg.val_docs),
                    cfg.text_column)
