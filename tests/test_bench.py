"""`python -m bench --smoke`: every section runs end to end and writes its JSON and Markdown record
(no timing assertions: the numbers only have to exist and be sane); the saved-bytes count against
counts made by hand."""
from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import re
import weakref

import pytest
import torch

from bench import main
from bench.gpt_memory import SavedBytes
from bench.images import GPU_RECORD, RUNS, WORKERS_PER_GPU

# --smoke: the zoo's names at their head counts (one block each), the other arms, then timm's DeiT-III.
VITS = {"vits": ["vits_0L", "vits_3L", "vits_6L", "vits_0L xsa", "vits_0L gated", "vits_0L diff",
                 "timm deit3_small_patch16_224"],
        "vitb": ["vitb_0L", "vitb_6L", "vitb_12L", "vitb_0L xsa", "vitb_0L gated", "vitb_0L diff",
                 "timm deit3_base_patch16_224"]}


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        result = main(["--smoke", "--rounds", "2", "--out", str(out)])
    (js,), (md,) = sorted(out.glob("*.json")), sorted(out.glob("*.md"))
    return json.loads(js.read_text()), md, result, stdout.getvalue()


def test_smoke_writes_one_json_and_one_markdown_record(smoke):
    rec, md, result, stdout = smoke
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d{6}_cpu_[a-z0-9-]+_smoke", md.stem), md.stem
    assert set(rec["sections"]) == {"vit", "gpt_memory", "loader"}
    for key in ("cpu", "cores", "cpu_capability", "torch", "timm", "python"):
        assert rec["machine"][key], key
    assert rec["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert rec["command"].startswith("python -m bench --smoke") and rec["args"]["smoke"] is True
    assert rec["args"]["clock"] == "cpu" and "- clock: cpu time" in md.read_text()  # one thread on a CPU
    text = md.read_text()
    assert text in stdout  # the record is printed too
    for title in ("## vit:", "## gpt_memory:", "## loader:", "torch CPU kernels"):
        assert title in text
    assert [str(f) for f in result["files"]] == [str(md.with_suffix(".json")), str(md)]


def test_vit_rows_and_their_ratios(smoke):
    rows = smoke[0]["sections"]["vit"]
    for family, names in VITS.items():
        for part in ("model", "attention"):
            got = [r for r in rows if r["family"] == family and r["part"] == part]
            assert [r["model"] for r in got] == names
            k0, timm = got[0], got[-1]
            assert k0["k"] == 0 and k0["attention"] == "softmax" and timm["k"] is None
            for r in got:
                assert positive(r["ms"]) and positive(r["saved_mib"]) and r["runs"] >= 2  # --rounds 2
                assert r["time / k=0"] == pytest.approx(r["ms"] / k0["ms"])
                assert r["saved / timm"] == pytest.approx(r["saved_mib"] / timm["saved_mib"])
    assert [r["attention"] for r in got] == ["softmax"] * 3 + ["xsa", "gated", "diff", None]
    assert len(rows) == 28


def test_gpt_memory_section_without_nanochat(smoke):
    rows = smoke[0]["sections"]["gpt_memory"]
    assert [(r["depth"], r["model"], r["k"]) for r in rows] == [(1, "gpt_d1_0L", 0)]  # one head: k = 0 only
    assert positive(rows[0]["saved_bytes_per_token"]) and "vs nanochat" not in rows[0]


def test_loader_section(smoke):
    rows = smoke[0]["sections"]["loader"]
    assert [r["path"] for r in rows] == ["decode only"] + [" ".join(o) for o in RUNS]
    for r in rows:
        assert positive(r["img_per_s"]) and r["supply / demand"] == pytest.approx(r["img_per_s"] / r["demand_per_worker"])
    # experiment=deit3_in1k trains at 192 px: 145 tokens an image against the record's 197 at 224.
    assert rows[1]["demand_per_worker"] == pytest.approx(GPU_RECORD["images_per_s"] * 197 / 145 / WORKERS_PER_GPU)


def test_sections_by_name_and_a_wrong_one(tmp_path, capsys):
    rec = main(["gpt_memory", "--smoke", "--out", str(tmp_path)])
    assert list(rec["tables"]) == ["gpt_memory"]
    with pytest.raises(SystemExit):
        main(["gpu_memory", "--smoke", "--out", str(tmp_path)])
    assert "section 'gpu_memory': choose from vit, gpt_memory, loader" in capsys.readouterr().err


def test_saved_bytes_counts_each_storage_once_and_no_parameters():
    """A linear layer keeps its input (the weight is left out); x * x saves x twice, one storage."""
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with SavedBytes(lin) as saved:
        lin(x)
    assert saved.bytes == 3 * 8 * 4
    with SavedBytes(lin) as saved:
        y = x * x  # mul saves both operands: the same storage
        y[:, :4].exp()  # exp saves its output: a new storage of 3 x 4 floats
    assert saved.bytes == 3 * 8 * 4 + 3 * 4 * 4


def test_saved_bytes_leaves_the_graph_collectable():
    """An op's own saved output must not keep its graph (and the model's weights) alive: the
    d20 comparison held one model per count until it ran out of memory."""
    x = torch.randn(3, 8, requires_grad=True)
    with SavedBytes(torch.nn.Linear(1, 1)):
        y = x.exp()  # exp saves its output
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None


# A folder laid out as nanochat's package, its GPT our own: the plumbing of --nanochat (the real
# gpt.py lives outside the repository; docs/benchmarks/ has its figures).
FAKE_NANOCHAT = """
from dataclasses import dataclass
import torch
from laplace.gpt import GPT as Ours

@dataclass
class GPTConfig:
    sequence_len: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int

class GPT(Ours):
    def __init__(self, c):
        super().__init__(c.vocab_size, c.n_layer, width=c.n_embd, num_heads=c.n_head, max_seq_len=c.sequence_len)
        self.transformer = torch.nn.ModuleDict({"wte": self.wte})
"""


def test_gpt_memory_against_a_nanochat_folder(tmp_path):
    (tmp_path / "ref" / "nanochat").mkdir(parents=True)
    (tmp_path / "ref" / "nanochat" / "gpt.py").write_text(FAKE_NANOCHAT)
    rec = main(["gpt_memory", "--smoke", "--nanochat", str(tmp_path / "ref"), "--out", str(tmp_path / "out")])
    df = rec["tables"]["gpt_memory"]
    assert list(df.model) == ["gpt_d1_0L", "nanochat eec0c79"]
    assert list(df["vs nanochat"]) == [1.0, 1.0] and df["within 1.02x"].all()
    with pytest.raises(SystemExit, match="no nanochat/gpt.py"):
        main(["gpt_memory", "--smoke", "--nanochat", str(tmp_path), "--out", str(tmp_path / "o")])
