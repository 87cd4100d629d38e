"""`python -m bench --smoke`: every case measured and written as a JSON record and a
Markdown table (no timing assertions: the numbers only have to exist and be sane)."""
from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest

from bench import main
from bench.report import git_commit, gpt_memory_markdown, markdown, ratios, record_stem

# --smoke: zoo names at their head counts (one block each); GPT depth 4 = 2 heads per layer.
EXPECTED = {
    "vits": {"vits_0L": 0, "vits_3L": 3, "vits_6L": 6, "timm deit3_small": None},
    "vitb": {"vitb_0L": 0, "vitb_6L": 6, "vitb_12L": 12, "timm deit3_base": None},
    "gpt": {"gpt_d4_0L": 0, "gpt_d4_1L": 1, "gpt_d4_2L": 2},
}


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        record = main(["--smoke", "--threads", "1", "--out", str(out)])
    record["stdout"] = stdout.getvalue()
    return out, record


def test_smoke_writes_one_json_and_one_markdown_record(smoke):
    out, record = smoke
    (js,), (md,) = sorted(out.glob("*.json")), sorted(out.glob("*.md"))
    assert js.stem == md.stem == record_stem(record)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_cpu_[a-z0-9-]+_smoke", js.stem), js.stem
    rec = json.loads(js.read_text())
    for key in ("schema", "date", "command", "args", "settings", "machine", "git_commit", "cases",
                "ratios", "loader", "images", "tokenizer", "analysis"):
        assert key in rec, key
    m = rec["machine"]
    for key in ("kind", "cpu", "cpu_count", "cpus_usable", "torch_threads", "python", "torch", "timm"):
        assert m[key], key
    assert m["kind"] == "cpu" and m["torch_threads"] == 1
    assert rec["args"]["smoke"] is True and rec["settings"]["modes"] == ["eager"]


def test_every_case_present_with_sane_numbers(smoke):
    out, _ = smoke
    rec = json.loads(next(out.glob("*.json")).read_text())
    for section in ("layer", "step"):
        for family, names in EXPECTED.items():
            got = {c["name"]: c for c in rec["cases"] if c["section"] == section and c["family"] == family}
            assert set(got) == set(names), (section, family, sorted(got))
            for name, k in names.items():
                c = got[name]
                assert c["k"] == k and c["impl"] == ("timm" if k is None else "laplace")
                steps = rec["settings"]["steps" if section == "step" else "layer_steps"]
                assert c["mode"] == "eager" and len(c["times_ms"]) == steps
                for key in ("median_ms", "min_ms", "max_ms", "saved_mb"):
                    assert positive(c[key]), (name, key, c[key])
                assert c["min_ms"] <= c["median_ms"] <= c["max_ms"]
                # RSS growth of a tiny step can be 0 (the allocator reuses memory): finite only
                assert math.isfinite(c["peak_mb"]) and c["peak_mb"] >= 0 and positive(c["cpu_ms"])
                if section == "step":
                    assert c["optimizer"].startswith("muon+adamw" if family == "gpt" else "adamw")
    assert len(rec["cases"]) == 2 * sum(map(len, EXPECTED.values()))


def test_ratios_have_targets_and_verdicts(smoke):
    out, _ = smoke
    rec = json.loads(next(out.glob("*.json")).read_text())
    # per section: vits and vitb 2 vs k=0 + 2 vs timm (k = 0 and all), gpt 2 vs k=0
    assert len(rec["ratios"]) == 2 * (4 + 4 + 2)
    for r in rec["ratios"]:
        assert r["target"] == (1.0 if r["kind"] == "vs timm" else 1.01)
        assert positive(r["time"]) and positive(r["time_min"]) and positive(r["memory"])
        assert r["memory_basis"] == "saved"
        assert r["time_met"] == (r["time"] <= r["target"]) and r["memory_met"] == (r["memory"] <= r["target"])


def test_loader_tokenizer_and_analysis_sections(smoke):
    out, _ = smoke
    rec = json.loads(next(out.glob("*.json")).read_text())
    ld = rec["loader"]
    assert ld["tokens"] > 0 and positive(ld["tokens_per_s"]) and ld["shards"] >= 1
    tk = rec["tokenizer"]
    assert tk["vocab"] == rec["args"]["tokenizer_vocab"] and tk["chars"] >= rec["args"]["tokenizer_chars"]
    assert [r["threads"] for r in tk["runs"]] == rec["args"]["tokenizer_threads"]
    for r in tk["runs"]:
        assert r["tokens"] > 0 and positive(r["tokens_per_s"]) and positive(r["tokens_per_s_per_thread"])
    assert 1 < tk["chars_per_token"] < 20  # a trained BPE merges bytes; no merge at all would give ~1
    assert [a["tokens"] for a in rec["analysis"]] == rec["args"]["analysis_tokens"]
    for a in rec["analysis"]:
        for key in ("update_tokens_per_s", "matmul_tokens_per_s", "update_vs_matmul", "peak_rss_mib",
                    "update_gflops", "matmul_gflops"):
            assert positive(a[key]), key


def test_images_section(smoke):
    """Every input path from both on-disk layouts, each decode mode, with its demand and the
    reduced-decode pixel difference (bench/images.py)."""
    from bench.images import MODES, WORKERS_PER_GPU

    out, _ = smoke
    im = json.loads(next(out.glob("*.json")).read_text())["images"]
    assert len(im["photos"]) >= 2 and all(p["size"] in ([500, 375], [375, 500]) for p in im["photos"])
    got = {(r["layout"], r["path"], r["decode"]) for r in im["rows"]}
    assert got == {(lay, p, m) for lay in ("folder", "parquet") for p, modes in MODES.items() for m in modes}
    for r in im["rows"]:
        assert r["items"] == 2 and positive(r["images_per_s"]) and positive(r["cpu_images_per_s"])
        assert r["demand_per_worker"] == pytest.approx(r["gpu_images_per_s"] / WORKERS_PER_GPU)
        assert r["supply_over_demand"] == pytest.approx(r["images_per_s"] / r["demand_per_worker"])
    assert {d["path"] for d in im["pixel_difference"]} == {"deit3", "timm_3a", "eval"}
    assert all(d["max_abs"] >= d["mean_abs"] >= 0 for d in im["pixel_difference"])


def test_gpt_memory_section_without_nanochat(smoke):
    """Ours alone (no --nanochat): k = 0 and with grad_checkpointing, which keeps less."""
    _, record = smoke
    mem = record["gpt_memory"]
    assert mem["dtype"] == "bf16 autocast" and mem["ratios"] == [] and mem["nanochat"] is None
    rows = {(r["name"], r["grad_checkpointing"]): r["saved_bytes_per_token"] for r in mem["rows"]}
    assert set(rows) == {("gpt_d1_0L", False), ("gpt_d1_0L", True)}
    assert 0 < rows[("gpt_d1_0L", True)] < rows[("gpt_d1_0L", False)]


# A folder laid out as nanochat's package, its GPT our own: the plumbing of --nanochat (the real
# gpt.py lives outside the repository; docs/LOG.md has its figures).
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


def test_gpt_memory_against_a_nanochat_folder(tmp_path, capsys):
    (tmp_path / "ref" / "nanochat").mkdir(parents=True)
    (tmp_path / "ref" / "nanochat" / "gpt.py").write_text(FAKE_NANOCHAT)
    record = main(["--smoke", "--sections", "gpt_memory", "--nanochat", str(tmp_path / "ref"),
                   "--out", str(tmp_path / "out")])
    mem = record["gpt_memory"]
    assert [r["impl"] for r in mem["rows"]] == ["laplace", "laplace", "nanochat"]
    (plain, ckpt) = mem["ratios"]
    assert plain["ratio"] == pytest.approx(1.0) and plain["met"] and ckpt["met"] is None
    assert "| 1 | gpt_d1_0L / nanochat eec0c79 | 1.0000 | met |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no nanochat/gpt.py"):
        main(["--smoke", "--sections", "gpt_memory", "--nanochat", str(tmp_path), "--out", str(tmp_path / "o")])


def test_gpt_memory_cuda_path_on_the_stand_in(monkeypatch):
    """The CUDA-only part runs through on tests/fakedevice.py's stand-in (which reports 0 bytes
    allocated): two Muon + AdamW steps of a model, the process cap, a peak per Laplacian model and
    OOM recorded as such. The stand-in cannot recompute a checkpointed block in backward (its
    tensors come back untagged), so the steps are run on the plain model."""
    import laplace
    import torch
    from fakedevice import fake_cuda
    from bench import gpt_memory
    from bench.cli import parse_args

    fractions, stepped = [], []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: fractions.append(f))
    with fake_cuda():
        model = laplace.create_model("gpt_d1_0L", vocab_size=256, max_seq_len=16).to("cuda")
        assert gpt_memory.peak_step_gib(model, 2, 16, 256, "cuda", compiled=False) == 0.0
        monkeypatch.setattr(gpt_memory, "peak_step_gib", lambda m, *a: stepped.append(m.grad_checkpointing)
                            or (None if m.grad_checkpointing else 1.5))
        args = parse_args(["--smoke", "--device", "cuda", "--sections", "gpt_memory", "--memory-cap-gib", "0.5"])
        mem = gpt_memory.run(args)
    assert fractions == [0.5] and stepped == [False, True]  # the cap: of the stand-in's 1 GiB
    assert [(r["oom"], r["peak_gib"]) for r in mem["rows"]] == [(False, 1.5), (True, None)]
    table = gpt_memory_markdown(mem)
    assert any(line.endswith("| 1.5 |") for line in table) and any(line.endswith("| OOM |") for line in table)


def test_markdown_has_the_tables(smoke):
    out, record = smoke
    text = next(out.glob("*.md")).read_text()
    assert text == markdown(record) and text in record["stdout"]  # the table is printed too
    for title in ("## Attention layer alone", "## Training step", "## Ratios and targets", "## LM loader",
                  "## Image input paths",
                  "## Tokenizer", "## Analysis accumulator", "## GPT activation memory"):
        assert title in text
    assert "| model | k | mode | shape | median ms |" in text
    for names in EXPECTED.values():
        for name in names:
            assert f"| {name} |" in text
    assert "met" in text and "<= 1.01" in text and "<= 1.00" in text


def test_ratio_verdicts():
    def case(name, k, impl, ms, saved):
        return dict(section="step", family="vitb", mode="eager", name=name, impl=impl, k=k, median_ms=ms,
                    min_ms=ms, peak_mb=1.0, saved_mb=saved, cpu_ms=ms)

    cs = [case("vitb_0L", 0, "laplace", 100.0, 10.0), case("vitb_12L", 12, "laplace", 101.5, 10.0),
          case("timm deit3_base", None, "timm", 100.0, 10.0)]
    rs = {(r["num"], r["den"]): r for r in ratios(cs, "cpu")}
    assert set(rs) == {("vitb_12L", "vitb_0L"), ("vitb_0L", "timm deit3_base"), ("vitb_12L", "timm deit3_base")}
    r = rs[("vitb_12L", "vitb_0L")]
    assert r["time"] == pytest.approx(1.015) and not r["time_met"] and r["memory_met"]
    assert rs[("vitb_0L", "timm deit3_base")]["time_met"]
    cuda = ratios(cs, "cuda")
    assert {r["memory_basis"] for r in cuda} == {"peak"}
    compiled = ratios([dict(c, mode="compiled") for c in cs], "cpu")  # RSS only: no memory verdict
    assert {(r["memory_basis"], r["memory_met"]) for r in compiled} == {("rss", None)}


def test_git_commit_from_refs_and_packed_refs(tmp_path):
    git = tmp_path / ".git"
    (git / "refs/heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text("# pack-refs\n" + "a" * 40 + " refs/heads/main\n")
    assert git_commit(tmp_path) == "a" * 40
    (git / "refs/heads/main").write_text("b" * 40 + "\n")
    assert git_commit(tmp_path) == "b" * 40
    assert git_commit(tmp_path / "nowhere") is None

