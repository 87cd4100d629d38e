"""`prepare`: a text source -> a tokenizer and token shards for the GPT (the command: prepare.py at
the repository root; every default: configs/prepare.yaml; the manual: docs/text_data.md), or with
`source=imagefolder` ImageNet's class folders -> parquet shards in the Hugging Face layout (.images)."""
import json
import time
from collections import Counter
from itertools import chain, islice
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from laplace.data.shards import shard_dtype
from laplace.errors import ConfigError
from laplace.io import atomic_write
from laplace.tokenizer import Tokenizer, capped_texts, cpu_cores, load_tokenizer, train_bpe

from .settings import TEXT_OUTPUTS, output_dir, pin, positive_int, remove_outputs, settings_of
from .sources import SourceError, open_source
from .writer import write_train, write_val

__all__ = ["SourceError", "make_tokenizer", "output_dir", "prepare"]

META_VERSION = 1


def make_tokenizer(cfg, out: Path, src, max_docs: int | None) -> Tokenizer:
    """tokenizer=bpe: out/tokenizer.json, trained here unless it exists; bytes | gpt2; or an
    existing file, copied to out/tokenizer.json so the folder is self-contained."""
    spec = str(cfg.tokenizer)
    path = out / "tokenizer.json"
    if spec != "bpe":  # bytes, gpt2, or a file (copied into out by prepare, once the settings are checked)
        return load_tokenizer(spec)
    vocab = positive_int(cfg, "vocab_size")  # (train_bpe says what a too small one must exceed)
    if path.is_file():  # a resumed run keeps its tokenizer: its shards' ids depend on it
        tok = load_tokenizer(path)
        if tok.vocab_size != vocab:
            raise ConfigError(f"vocab_size={vocab} but {path} (from an earlier run) has "
                              f"{tok.vocab_size}; set vocab_size={tok.vocab_size} or another out")
        return tok
    chars = positive_int(cfg, "tokenizer_train_chars")
    doc_chars = positive_int(cfg, "tokenizer_doc_chars")
    print(f"[prepare] training a BPE tokenizer (vocab {vocab:,}) on up to {chars:,} characters",
          flush=True)
    t = time.perf_counter()
    # On the training documents only (nanochat: each cut to doc_chars, up to chars in all).
    docs = islice(chain.from_iterable(src.train_batches(0, 1024)), max_docs)  # max_docs None: all
    tok = train_bpe(capped_texts(docs, chars, doc_chars), vocab, path)
    print(f"[prepare] tokenizer trained in {time.perf_counter() - t:.1f} s -> {path}", flush=True)
    return load_tokenizer(path)


def prepare(cfg: DictConfig) -> dict:
    """Write the tokenizer, shards and meta.json of cfg (configs/prepare.yaml); returns the meta."""
    if OmegaConf.is_missing(cfg, "source"):
        raise ConfigError("source is required: source=pydoc | stdlib | a parquet folder or glob | a "
                          "datasets hub id (e.g. source=pydoc vocab_size=4096) | imagefolder (in=<ImageNet folder>)")
    if cfg.source == "imagefolder":
        from .images import prepare_images

        return prepare_images(cfg)
    docs_per_shard = positive_int(cfg, "docs_per_shard")
    val_docs = positive_int(cfg, "val_docs", allow_zero=True)
    max_docs = positive_int(cfg, "max_docs", allow_null=True)
    batch_docs = positive_int(cfg, "batch_docs")
    threads = positive_int(cfg, "num_workers", allow_null=True) or cpu_cores()
    cores = min(threads, cpu_cores())
    t0 = time.perf_counter()

    src = open_source(cfg)
    # <source>_<tokenizer kind> (a tokenizer file is a bpe)
    out = output_dir(cfg, f"{src.name}_{cfg.tokenizer if cfg.tokenizer in ('bytes', 'gpt2') else 'bpe'}")
    settings = {**settings_of(cfg), "source_files": src.fingerprint()}
    remove_outputs(out, TEXT_OUTPUTS, everything=bool(cfg.rebuild))  # a killed run's temp files; rebuild: all
    # Pinned before the first shard, twice: before training a BPE (minutes, wasted on a refused
    # folder), and with the tokenizer's fingerprint, which pins the ids the finished shards hold.
    pin(out, settings, src.describe(), record=False)
    tok = make_tokenizer(cfg, out, src, max_docs)
    settings["tokenizer_fingerprint"] = tok.fingerprint()
    pin(out, settings, src.describe())
    if tok.kind == "bpe" and Path(tok.spec) != (out / "tokenizer.json").absolute():
        # A given BPE file: copied in, so the folder is self-contained (train.py reads it there).
        tok.save(out / "tokenizer.json")
        tok = load_tokenizer(out / "tokenizer.json")

    print(f"[prepare] {src.describe()} -> {out} ({tok.kind} tokenizer, vocab {tok.vocab_size:,}, "
          f"{threads} threads)", flush=True)
    stats = Counter()  # documents, tokens and seconds tokenized (writer.encode_docs)
    train = write_train(src, tok, out / "train", docs_per_shard, max_docs, batch_docs, threads,
                        stats, bool(cfg.progress))
    if not train:
        raise ConfigError(f"source={cfg.source} gave no training documents ({src.describe()}, "
                          f"max_docs={max_docs}); check source, split, val_split and val_docs")
    val = write_val(src, tok, out / "val", val_docs, batch_docs, threads, stats)

    meta = {"version": META_VERSION, "source": src.describe(), "settings": settings,
            "tokenizer": tok.spec, "tokenizer_kind": tok.kind, "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id, "dtype": shard_dtype(tok.vocab_size).name,
            **{name: {"docs": sum(s["docs"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                      "shards": shards} for name, shards in (("train", train), ("val", val))}}
    atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode())  # last: the folder is complete

    tr, va = meta["train"], meta["val"]
    print(f"[prepare] train: {tr['docs']:,} documents, {tr['tokens']:,} tokens in "
          f"{len(train)} shards; val: {va['docs']:,} documents, {va['tokens']:,} tokens", flush=True)
    if stats["tokens"]:  # also per core: the threads tokenize without the GIL, so it scales with cores
        tps = stats["tokens"] / max(stats["seconds"], 1e-9)
        print(f"[prepare] tokenized {stats['docs']:,} documents, {stats['tokens']:,} tokens in "
              f"{stats['seconds']:.1f} s: {tps:,.0f} tokens/s, {tps / cores:,.0f} tokens/s per "
              f"core ({threads} threads on {cores} cores); total {time.perf_counter() - t0:.1f} s", flush=True)
    else:
        print("[prepare] all shards existed: nothing tokenized", flush=True)
    print(f"[prepare] wrote {out / 'meta.json'}", flush=True)
    return meta
