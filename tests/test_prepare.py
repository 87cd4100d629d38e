"""prepare.py / laplace.data.prepare: parquet in the FineWeb-Edu layout and the built-in text -> tokenizer,
shards and meta.json; deterministic shards, resuming after a kill, one-line input errors."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

import laplace.data.prepare as prep
import laplace.data.prepare.writer as writer
from laplace.data import DatasetNotFoundError
from laplace.data.shards import TokenStream, list_shards
from laplace.checkpoint import save_checkpoint
from laplace.errors import ConfigError, UserError
from laplace.io import write_json
from laplace.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the model reads tokens and predicts the next one while attention heads mix "
         "information across positions Laplacian graph spectrum eigenvalue café naïve 🙂 "
         "def return 1234 5678 x = y + z").split()


def make_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
            for i in range(n)]


@pytest.fixture
def fineweb(tmp_path) -> tuple[Path, list[str], list[str]]:
    """3 parquet files (shard_0000{0,1,2}.parquet), row groups of 16 rows; the last is val."""
    folder = tmp_path / "fineweb"
    folder.mkdir()
    files = [make_docs(70, 0), make_docs(50, 1), make_docs(30, 2)]
    for k, docs in enumerate(files):
        table = pa.table({"text": docs, "id": list(range(len(docs)))})
        pq.write_table(table, folder / f"shard_{k:05d}.parquet", row_group_size=16)
    return folder, files[0] + files[1], files[2]


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("prepare", overrides=["progress=false", "num_workers=2", *overrides])


def parquet_cfg(src: Path, out: Path, *more: str):
    return make_cfg(f"source={src}", f"out={out}", "vocab_size=320", "docs_per_shard=25",
                    "val_docs=20", "batch_docs=7", *more)


def split_docs(tokens: np.ndarray, bos: int) -> list[np.ndarray]:
    starts = np.flatnonzero(tokens == bos)
    assert starts[0] == 0  # every shard starts with a document
    return np.split(tokens, starts[1:])


def test_parquet_to_shards(fineweb, tmp_path):
    src, train_docs, val_docs = fineweb
    out = tmp_path / "out"
    meta = prep.prepare(parquet_cfg(src, out))
    tok = load_tokenizer(out / "tokenizer.json")
    assert meta["tokenizer"] == str((out / "tokenizer.json").absolute()) and meta["vocab_size"] == 320
    assert meta["dtype"] == "uint16" and meta["bos_id"] == tok.bos_id
    # shard i = training documents [25 i, 25 i + 25): 120 documents -> 25, 25, 25, 25, 20
    assert [s["docs"] for s in meta["train"]["shards"]] == [25, 25, 25, 25, 20]
    files = list_shards(out, "train")
    assert [f.name for f in files] == [f"shard_{i:05d}.npy" for i in range(5)]
    decoded = []
    for f, s in zip(files, meta["train"]["shards"]):
        arr = np.load(f)
        assert arr.dtype == np.uint16 and len(arr) == s["tokens"]
        decoded += [tok.decode(d) for d in split_docs(arr, tok.bos_id)]
    assert decoded == ["<|bos|>" + d for d in train_docs]
    val = np.load(list_shards(out, "val")[0])
    assert [tok.decode(d) for d in split_docs(val, tok.bos_id)] == ["<|bos|>" + d for d in val_docs[:20]]
    assert meta["val"]["docs"] == 20 and meta["train"]["docs"] == 120
    assert json.loads((out / "meta.json").read_text()) == meta
    assert not [p for p in out.rglob(".*.tmp")]


def test_max_docs_and_glob(fineweb, tmp_path):
    src, train_docs, _ = fineweb
    meta = prep.prepare(parquet_cfg(f"{src}/shard_*.parquet", tmp_path / "o", "max_docs=60",
                                    "tokenizer=bytes"))
    assert [s["docs"] for s in meta["train"]["shards"]] == [25, 25, 10]
    arr = np.concatenate([np.load(f) for f in list_shards(tmp_path / "o", "train")])
    assert arr.dtype == np.uint16 and meta["bos_id"] == 256 and meta["vocab_size"] == 265
    assert bytes(arr[arr != 256].astype(np.uint8)) == "".join(train_docs[:60]).encode()


def _identical(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a) for p in a.rglob("*.npy"))
    assert names == sorted(p.relative_to(b) for p in b.rglob("*.npy")) and names
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_resume_after_kill_is_byte_identical(fineweb, tmp_path, monkeypatch):
    src = fineweb[0]
    full, killed = tmp_path / "full", tmp_path / "killed"
    ref = prep.prepare(parquet_cfg(src, full))

    real, calls = writer.write_shard, []

    def dies_after_two(path, tokens, vocab_size):
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        calls.append(path)
        return real(path, tokens, vocab_size)

    monkeypatch.setattr(writer, "write_shard", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(parquet_cfg(src, killed))
    assert not (killed / "meta.json").exists()
    assert sorted(p.name for p in (killed / "train").glob("*.npy")) == ["shard_00000.npy", "shard_00001.npy"]
    monkeypatch.setattr(writer, "write_shard", real)

    # a stale temp file of write_shard (a kill during a write) is ignored and never used
    (killed / "train" / ".shard_00002.npy.x1y2.tmp").write_bytes(b"\x93NUMPY garbage")
    # the re-run must not tokenize the documents of the finished shards again
    encoded = []
    monkeypatch.setattr(writer, "encode_docs", lambda tok, docs, *a: (encoded.extend(docs),
                                                                    real_encode(tok, docs, *a))[1])
    meta = prep.prepare(parquet_cfg(src, killed))
    assert not list(killed.rglob("*.tmp"))  # the killed run's temp files are deleted
    assert len(encoded) == 120 - 50 + 20  # train shards 2..4 and the val shard
    _identical(full, killed)
    assert meta["train"] == ref["train"] and meta["val"] == ref["val"]
    assert [f.name for f in list_shards(killed, "train")] == [f"shard_{i:05d}.npy" for i in range(5)]

    # a third run finds everything done
    encoded.clear()
    assert prep.prepare(parquet_cfg(src, killed))["train"] == ref["train"] and not encoded


real_encode = writer.encode_docs


def test_resume_after_sigkill_subprocess(fineweb, tmp_path):
    """A real kill: the process is SIGKILLed right after its second shard is renamed into place."""
    src = fineweb[0]
    prep.prepare(parquet_cfg(src, tmp_path / "full"))
    out = tmp_path / "killed"
    script = """
import os, runpy, signal
import laplace.data.shards as shards
write_shard, n = shards.write_shard, []
def write(*a):
    p = write_shard(*a)
    n.append(p)
    if len(n) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return p
shards.write_shard = write  # taken by the library's own import, which prepare.py starts
runpy.run_path("prepare.py", run_name="__main__")
"""
    args = [f"source={src}", f"out={out}", "vocab_size=320", "docs_per_shard=25", "val_docs=20",
            "batch_docs=7", "progress=false", "num_workers=2"]
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == -9, r.stderr
    assert len(list((out / "train").glob("*.npy"))) == 2 and not (out / "meta.json").exists()
    prep.prepare(parquet_cfg(src, out))
    _identical(tmp_path / "full", out)


def test_rerun_with_other_settings_is_refused(fineweb, tmp_path):
    src, out = fineweb[0], tmp_path / "out"
    prep.prepare(parquet_cfg(src, out, "tokenizer=bytes"))
    with pytest.raises(ConfigError) as e:
        prep.prepare(parquet_cfg(src, out, "tokenizer=bytes", "docs_per_shard=10"))
    assert "holds shards made with docs_per_shard=25, not 10: set it back" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("docs_per_shard", [25, 10])
def test_source_that_grew_is_refused(fineweb, tmp_path, docs_per_shard):
    """A parquet file added to the folder after a prepare: the old last (validation) file
    would become training text (full last shard) or be ignored (partial last shard)."""
    src, train_docs, val_docs = fineweb
    out = tmp_path / "out"
    more = (f"docs_per_shard={docs_per_shard}", "tokenizer=bytes")
    before = prep.prepare(parquet_cfg(src, out, *more))
    added = make_docs(40, 3)
    pq.write_table(pa.table({"text": added}), src / "shard_00003.parquet", row_group_size=16)
    with pytest.raises(ConfigError) as e:
        prep.prepare(parquet_cfg(src, out, *more))
    msg = _one_line(e)
    assert f"source={src} changed" in msg and "shard_00003.parquet added" in msg
    assert "rebuild=true" in msg and "out=" in msg
    assert json.loads((out / "meta.json").read_text()) == before  # nothing was touched
    # rebuild=true starts again: the old validation file is training text now, the new one val
    meta = prep.prepare(parquet_cfg(src, out, *more, "rebuild=true"))
    assert meta["train"]["docs"] == len(train_docs) + len(val_docs) and meta["val"]["docs"] == 20
    tok = load_tokenizer("bytes")
    val = np.load(list_shards(out, "val")[0])
    assert tok.decode(val) == "".join("<|bos|>" + d for d in added[:20])
    # a changed file (same name, other rows) is refused too
    pq.write_table(pa.table({"text": added[:30]}), src / "shard_00003.parquet")
    with pytest.raises(ConfigError, match="shard_00003.parquet changed"):
        prep.prepare(parquet_cfg(src, out, *more))
    # a folder prepared before sources were pinned: its meta.json names the old split
    settings = json.loads((out / ".settings.json").read_text())
    del settings["source_files"]
    (out / ".settings.json").write_text(json.dumps(settings))
    pq.write_table(pa.table({"text": added}), src / "shard_00004.parquet")
    with pytest.raises(ConfigError, match=r"was .*3 train files \+ shard_00003.parquet for val\), now "
                                          r".*4 train files \+ shard_00004.parquet.*rebuild=true"):
        prep.prepare(parquet_cfg(src, out, *more))


def _damaged(folder: Path, name: str, how: str) -> Path:
    path = folder / name
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "binary":
        pq.write_table(pa.table({"text": [b"bytes, not text"] * 5}), path)
    elif how == "utf8":
        rows = pa.array([b"fine", b"also fine", b"bad \xff\xfe here"], pa.binary()).view(pa.string())
        pq.write_table(pa.table({"text": rows}), path)
    elif how == "garbage":
        path.write_bytes(b"PAR1" + bytes(range(256)) * 8)
    return path


@pytest.mark.parametrize("how, name, expect", [
    ("truncated", "shard_00000.parquet", "not a readable parquet file"),
    ("garbage", "shard_00001.parquet", "not a readable parquet file"),
    ("binary", "shard_00000.parquet", "holds binary, not text"),
    ("utf8", "shard_00001.parquet", "row 2 of column 'text' is not valid UTF-8"),
    ("utf8", "shard_00002.parquet", "row 2 of column 'text' is not valid UTF-8")])
def test_unreadable_source_file_is_one_line_naming_it(fineweb, tmp_path, how, name, expect):
    path = _damaged(fineweb[0], name, how)
    with pytest.raises(prep.SourceError) as e:
        prep.prepare(parquet_cfg(fineweb[0], tmp_path / "out", "tokenizer=bytes"))
    msg = _one_line(e)
    assert msg.startswith(str(path)) and expect in msg


def test_unreadable_source_on_the_command_line(fineweb, tmp_path):
    path = _damaged(fineweb[0], "shard_00001.parquet", "utf8")
    r = subprocess.run([sys.executable, "prepare.py", f"source={fineweb[0]}",
                        f"out={tmp_path}/out", "tokenizer=bytes", "progress=false"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith(f"error: {path}: row 2")


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_outputs_get_the_umask_modes(fineweb, tmp_path, umask, mode):
    """Not mkstemp's 0600: on a shared cluster the group reads the prepared data."""
    old = os.umask(umask)
    try:
        out = tmp_path / "out"
        prep.prepare(parquet_cfg(fineweb[0], out))
        files = [*out.rglob("*.npy"), out / "tokenizer.json", out / "meta.json", out / ".settings.json"]
        assert len(files) == 9
        assert {str(f.relative_to(out)): oct(f.stat().st_mode & 0o777) for f in files} == \
            {str(f.relative_to(out)): oct(mode) for f in files}
        assert (write_json(tmp_path / "results.json", {"a": 1}).stat().st_mode & 0o777) == mode
        ckpt = save_checkpoint(tmp_path / "ckpt" / "last.pt", model=torch.nn.Linear(2, 2), config={})
        assert (ckpt.stat().st_mode & 0o777) == mode
    finally:
        os.umask(old)


def test_token_stream_over_prepared_shards(fineweb, tmp_path):
    out = tmp_path / "out"
    meta = prep.prepare(parquet_cfg(fineweb[0], out))
    files = list_shards(out, "train")
    stream = TokenStream(files, seq_len=32, micro_batch_size=4)
    assert stream.num_tokens == meta["train"]["tokens"]
    it = iter(stream)
    for _ in range(3):
        next(it)
    state = stream.state_dict()
    x_next, y_next = next(it)
    assert x_next.shape == (4, 32) and (x_next[:, 1:] == y_next[:, :-1]).all()
    resumed = TokenStream(files, seq_len=32, micro_batch_size=4)
    resumed.load_state_dict(state)
    x, y = next(iter(resumed))
    assert (x == x_next).all() and (y == y_next).all()
    stream_all = np.concatenate([np.load(f) for f in files]).astype(np.int64)
    assert (x[0].numpy() == stream_all[3 * 4 * 32: 3 * 4 * 32 + 32]).all()


def test_pydoc_source(tmp_path):
    meta = prep.prepare(make_cfg("source=pydoc", f"paths.data_dir={tmp_path}", "vocab_size=512",
                                 "max_docs=20", "docs_per_shard=8", "val_docs=3"))
    out = tmp_path / "pydoc_bpe"
    assert (out / "meta.json").is_file() and (out / "tokenizer.json").is_file()
    assert [s["docs"] for s in meta["train"]["shards"]] == [8, 8, 4] and meta["val"]["docs"] == 3
    from laplace.data.text import pydoc_documents

    tok = load_tokenizer(out / "tokenizer.json")
    val = np.load(list_shards(out, "val")[0])
    assert tok.decode(val) == "".join("<|bos|>" + d for d in pydoc_documents(train=False)[:3])


def test_stdlib_source(tmp_path):
    """source=stdlib: Python's own standard library, without what is installed in site-packages
    (which differs between machines)."""
    import sysconfig

    from laplace.data.text import stdlib_documents, stdlib_texts

    texts = stdlib_texts()
    assert len(texts) > 500
    root = Path(sysconfig.get_paths()["stdlib"])
    assert (root / "json" / "__init__.py").read_text(errors="replace") in texts
    site = [f for f in root.rglob("site-packages/*.py")][:20]
    assert not {f.read_text(errors="replace") for f in site if f.stat().st_size} & set(texts)
    train, val = stdlib_documents(True), stdlib_documents(False)
    # The split is by file (path position); files are cut into pieces at line ends, each split's
    # pieces then in a fixed random order (shards are read in order).
    from laplace.data.text import _pieces

    pieces = [_pieces(t, 2000) for t in texts]
    assert all("".join(p) == t for p, t in zip(pieces, texts))
    assert all(len(x) <= 2000 or "\n" not in x[:-1] for p in pieces for x in p)
    val_pieces = sorted(x for p in pieces[3::4] for x in p if x.strip())
    assert sorted(val) == val_pieces and val != val_pieces
    assert sorted(train) == sorted(x for i, p in enumerate(pieces) if i % 4 != 3 for x in p if x.strip())
    assert val == stdlib_documents(False) and train[:5] == stdlib_documents(True)[:5]  # a fixed order
    assert _pieces("a\nbb\nccc\n", 5) == ["a\nbb\n", "ccc\n"] and _pieces("x" * 9, 5) == ["x" * 9]
    meta = prep.prepare(make_cfg("source=stdlib", f"paths.data_dir={tmp_path}", "vocab_size=512",
                                 "max_docs=6", "docs_per_shard=4", "val_docs=2", "tokenizer_train_chars=200000"))
    out = tmp_path / "stdlib_bpe"
    assert [s["docs"] for s in meta["train"]["shards"]] == [4, 2] and meta["val"]["docs"] == 2
    tok = load_tokenizer(out / "tokenizer.json")
    assert tok.decode(np.load(list_shards(out, "val")[0])) == "".join("<|bos|>" + d for d in val[:2])
    # Shards made when the files came in path order are refused, not resumed into.
    settings = json.loads((out / ".settings.json").read_text())
    (out / ".settings.json").write_text(json.dumps({**settings, "source_files": None}))
    with pytest.raises(ConfigError, match="source=stdlib changed since .*rebuild=true"):
        prep.prepare(make_cfg("source=stdlib", f"paths.data_dir={tmp_path}", "vocab_size=512", "max_docs=6",
                              "docs_per_shard=4", "val_docs=2", "tokenizer_train_chars=200000"))


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    return str(e.value)


def test_missing_source(tmp_path):
    with pytest.raises(DatasetNotFoundError) as e:
        prep.prepare(parquet_cfg(tmp_path / "nope", tmp_path / "out"))
    assert str(tmp_path / "nope") in _one_line(e) and "source" in str(e.value)
    with pytest.raises(DatasetNotFoundError) as e:
        prep.prepare(parquet_cfg(f"{tmp_path}/nope/*.parquet", tmp_path / "out"))
    assert "source=" in _one_line(e)


def test_missing_text_column(fineweb, tmp_path):
    with pytest.raises(ConfigError) as e:
        prep.prepare(parquet_cfg(fineweb[0], tmp_path / "out", "text_column=content"))
    msg = _one_line(e)
    assert "text_column=content" in msg and "'text'" in msg and "'id'" in msg


def test_bad_values(fineweb, tmp_path):
    with pytest.raises(ConfigError) as e:
        prep.prepare(parquet_cfg(fineweb[0], tmp_path / "out", "docs_per_shard=0"))
    assert "docs_per_shard=0" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        prep.prepare(parquet_cfg(fineweb[0], tmp_path / "out", "vocab_size=200"))
    assert "vocab_size=200" in _one_line(e)
    one = tmp_path / "one"
    one.mkdir()
    pq.write_table(pa.table({"text": ["a"]}), one / "shard_00000.parquet")
    with pytest.raises(ConfigError) as e:
        prep.prepare(parquet_cfg(one, tmp_path / "out"))
    assert "at least two" in _one_line(e)


def test_command_line_error_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "prepare.py", f"source={tmp_path}/nope",
                        f"out={tmp_path}/out"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"error: source={tmp_path}/nope not found: looked for {tmp_path}/nope; set source to a folder or glob "
        "of parquet files, pydoc, stdlib, or a datasets hub id (e.g. HuggingFaceFW/fineweb-edu)"], r.stderr[-2000:]


def test_datasets_local_folder(tmp_path, monkeypatch):
    """The `datasets` route (hub ids use the same code) on a local dataset folder, offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "ds" / "data"
    folder.mkdir(parents=True)
    docs = make_docs(30, 7)
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": d, "n": i}) + "\n"
                                                for i, d in enumerate(docs)))
    out = tmp_path / "out"
    # no val_split: the first val_docs documents are the validation shard, train skips them
    meta = prep.prepare(make_cfg(f"source={folder.parent}", f"out={out}", "tokenizer=bytes",
                                 "docs_per_shard=10", "val_docs=4", "batch_docs=3"))
    assert [s["docs"] for s in meta["train"]["shards"]] == [10, 10, 6] and meta["val"]["docs"] == 4
    tok = load_tokenizer("bytes")
    train = np.concatenate([np.load(f) for f in list_shards(out, "train")])
    assert tok.decode(train) == "".join("<|bos|>" + d for d in docs[4:])
    assert tok.decode(np.load(list_shards(out, "val")[0])) == "".join("<|bos|>" + d for d in docs[:4])
    with pytest.raises(ConfigError) as e:
        prep.prepare(make_cfg(f"source={folder.parent}", f"out={tmp_path / 'o2'}", "tokenizer=bytes",
                              "text_column=body", "val_docs=4"))
    assert "text_column=body" in _one_line(e) and "'n'" in str(e.value)


def test_the_library_has_no_command_line_entry():
    """prepare's command is prepare.py at the root: a Hydra entry inside laplace/ pointed at
    '../../configs', a folder a non-editable install does not have."""
    entries = [p.relative_to(ROOT) for p in (ROOT / "laplace").rglob("*.py") if "@hydra.main" in p.read_text()]
    assert entries == []
    r = subprocess.run([sys.executable, "-m", "laplace.data.prepare", "source=pydoc"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "cannot be directly executed" in r.stderr  # never a silent no-op
