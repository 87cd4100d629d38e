"""nanochat's 2026 GPT as options of laplace.gpt.GPT (`gpt26_d{depth}_{k}L`) and its checkpoints
(laplace.nanochat). The parity test at the end runs upstream nanochat's own gpt.py with the first
author's Laplacian lines beside ours; it is skipped unless LAPLACE_NANOCHAT names a checkout of
karpathy/nanochat at 92d63d4:

    LAPLACE_NANOCHAT=/tmp/nanochat python -m pytest -s tests/test_gpt26.py -k parity
"""
import json
import os
import pickle
import sys

import pytest
import tiktoken
import torch

import laplace
from laplace import nanochat
from laplace.checkpoint import load_model, save_checkpoint
from train.config import model_node
from conftest import randomize_

V, SEQ = 300, 512  # windows: a quarter of 512 rounded up to 128 -> short windows of 128 keys back
T = 200  # > the short window: it bites


def gpt26(k=0, seed=0, **kw):
    """A small 2026 GPT (4 layers, 128 wide, 4 heads) with random non-trivial weights."""
    torch.manual_seed(seed)
    kw = {"vocab_size": V, "max_seq_len": SEQ, "depth": 4, "width": 128, "num_heads": 4, **kw}
    model = laplace.create_model("gpt26", num_laplacian_heads=k, **kw)
    randomize_(model, seed)
    return model.eval()


def tokens(n=T, b=2, seed=0):
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


def test_zoo_names_and_shapes():
    m = laplace.create_model("gpt26_d3_1L", vocab_size=V)
    assert (m.width, m.num_heads, m.head_dim) == (256, 2, 128)  # 2026: width up to whole heads
    assert m.wte.weight.shape[0] == 320 and m(tokens(8)).shape == (2, 8, V)  # padded to 64, cropped
    assert m.windows == [512, 512, None]  # SSSL tiled (2048 / 4), the last layer long
    assert laplace.model_label(model_node("gpt26_d12_2L")) == "gpt26_d12_2L"
    assert model_node("gpt26_d12_2L")["window_pattern"] == "SSSL"
    with pytest.raises(laplace.zoo.UnknownModelError):
        laplace.create_model("gpt26_d4_3L")  # 2 heads


def test_init_is_nanochats():
    torch.manual_seed(0)
    m = laplace.create_model("gpt26_d12_0L", vocab_size=4096)
    s = 3 ** 0.5 / 768 ** 0.5
    assert m.resid_lambdas[0].item() == pytest.approx(1.15) and m.resid_lambdas[-1].item() == pytest.approx(1.05)
    assert m.x0_lambdas[0].item() == pytest.approx(0.20) and m.x0_lambdas[-1].item() == pytest.approx(0.05)
    assert m.backout_lambda.item() == pytest.approx(0.2) and m.smear_lambda.item() == 0
    assert m.wte.weight.std().item() == pytest.approx(0.8, rel=0.01)
    assert m.lm_head.weight.std().item() == pytest.approx(0.001, rel=0.01)
    blk = m.blocks[11]
    assert blk.attn.qkv.weight.abs().max() <= s and blk.mlp.c_fc.weight.abs().max() <= 0.4 * s
    assert blk.attn.qkv.weight.abs().max() > 0.99 * s
    assert not blk.attn.proj.weight.any() and not blk.mlp.c_proj.weight.any()
    assert 0 <= blk.attn.ve_gate.weight.min() and blk.attn.ve_gate.weight.max() <= 0.02
    assert list(m.value_embeds) == [str(i) for i in range(1, 12, 2)]  # alternating, the last included


@pytest.mark.parametrize("switch,gone", [("use_ve", "value_embeds.3.weight"), ("use_resid_lambdas", "resid_lambdas"),
                                         ("use_x0", "x0_lambdas"), ("use_smear", "smear_gate.weight"),
                                         ("use_backout", "backout_lambda")])
def test_switches_remove_their_parameters(switch, gone):
    on, off = gpt26().state_dict(), gpt26(**{switch: False}).state_dict()
    assert gone in on and gone not in off
    assert torch.isfinite(gpt26(2, **{switch: False})(tokens(16))).all()


@pytest.mark.parametrize("k", [0, 2, 4])
def test_causal_and_fused_equals_reference(k):
    """Windows, GQA, smear and value embeddings keep the model causal; SDPA's path equals P formed."""
    m, idx = gpt26(k, num_kv_heads=2), tokens()
    with torch.no_grad():
        z = m(idx)
        later = idx.clone()
        later[:, 150:] = (later[:, 150:] + 1) % V
        torch.testing.assert_close(m(later)[:, :150], z[:, :150])
        for blk in m.blocks:
            blk.attn.fused_attn = False
        torch.testing.assert_close(m(idx), z, atol=2e-5, rtol=1e-5)


def test_windows_bite_beyond_the_short_window():
    """SSSL equals L while the short window still covers every key (t <= 128), differs after."""
    idx = tokens()
    with torch.no_grad():
        a, b = gpt26(2)(idx), gpt26(2, window_pattern="L")(idx)
    torch.testing.assert_close(a[:, :129], b[:, :129])
    assert (a[:, 129:] - b[:, 129:]).abs().amax(-1).min() > 1e-4


@pytest.mark.parametrize("k", [0, 1, 4])
def test_gqa_equals_repeated_kv(k):
    """2 kv heads for 4 query heads = 4 kv heads holding each kv head twice (Laplacian v too)."""
    gqa, full = gpt26(k, num_kv_heads=2), gpt26(k)
    sd, D = gqa.state_dict(), 32
    for key, t in sd.items():
        if key.endswith("qkv.weight"):  # [q (4 D), k (2 D), v (2 D)] -> [q, k k, v v] per head
            q, kv = t[:4 * D], t[4 * D:].view(4, D, -1)  # k0 k1 v0 v1
            sd[key] = torch.cat((q, kv.repeat_interleave(2, dim=0).flatten(0, 1)))
        elif key.endswith("ve_gate.weight"):
            sd[key] = t.repeat_interleave(2, dim=0)
        elif key.startswith("value_embeds"):
            sd[key] = t.view(V + 20, 2, D).repeat_interleave(2, dim=1).flatten(1)
    full.load_state_dict(sd)
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx), full(idx), atol=2e-5, rtol=1e-5)


def test_kv_cache_generation_equals_full_forwards():
    """The smear's predecessor and the windows' masks carried through the cache."""
    m, prompt = gpt26(2, num_kv_heads=2), tokens(140, b=1)
    greedy = m.generate(prompt, 6, temperature=0)
    torch.testing.assert_close(greedy, m.generate(prompt, 6, temperature=0, use_cache=False))
    cache = m.new_kv_cache(1, 150)
    with torch.no_grad():
        m(prompt[:, :130], kv_cache=cache)
        torch.testing.assert_close(m(prompt[:, 130:], kv_cache=cache), m(prompt)[:, 130:], atol=2e-5, rtol=1e-5)


def nanochat_folder(path, model, model_config, step=20):
    """Our model saved as nanochat saves its own: model_<step>.pt (its names) + meta_<step>.json."""
    sd, H, Hkv, D = {}, model.num_heads, model.num_kv_heads, model.head_dim
    for key, t in model.state_dict().items():
        key = key.replace("blocks.", "transformer.h.").replace("attn.proj", "attn.c_proj")
        if key.endswith("qkv.weight"):
            for name, part in zip("qkv", t.split([H * D, Hkv * D, Hkv * D])):
                sd[key.replace("qkv", f"c_{name}")] = part.clone()
        else:
            sd[key.replace("wte", "transformer.wte")] = t.clone()
    path.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path / f"model_{step:06d}.pt")
    (path / f"meta_{step:06d}.json").write_text(json.dumps({"step": step, "model_config": model_config}))
    return path


@pytest.mark.parametrize("lap", [0, [0, 1, 2, 4]])
def test_nanochat_folder_round_trip(tmp_path, lap):
    m = gpt26(lap, num_kv_heads=2, use_smear=False)
    cfg = dict(sequence_len=SEQ, vocab_size=V, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, window_pattern="SSSL",
               laplacian_heads=lap, use_smear=False)
    folder = nanochat_folder(tmp_path, m, cfg)
    idx = tokens()
    with torch.no_grad():  # laplace.nanochat.load, and the one loader that sends such a folder to it
        assert torch.equal(nanochat.load(folder)(idx), m(idx)) and torch.equal(load_model(folder)(idx), m(idx))
    # ours in our own checkpoint too
    ckpt = save_checkpoint(tmp_path / "last.pt", model=m, config={"model": nanochat.model_node(cfg)})
    with torch.no_grad():
        assert torch.equal(load_model(ckpt)(idx), m(idx))


def test_missing_step_is_one_line(tmp_path):
    folder = nanochat_folder(tmp_path, gpt26(), dict(sequence_len=SEQ, vocab_size=V, n_layer=4, n_head=4,
                                                     n_kv_head=4, n_embd=128))
    assert nanochat.load(folder).windows == [None] * 4  # a checkpoint from before windows: full context
    assert not nanochat.load(folder, fused_attn=False).blocks[0].attn.fused_attn
    with pytest.raises(laplace.errors.UserError, match="model_000007.pt"):
        nanochat.load(folder, step=7)
    sd = torch.load(folder / "model_000020.pt")
    del sd["smear_lambda"]  # e.g. from before the smear
    torch.save(sd, folder / "model_000020.pt")
    with pytest.raises(laplace.errors.UserError, match='do not match .*"smear_lambda"'):
        nanochat.load(folder)


def test_tokenizer_pickle_is_read_without_running_it(tmp_path):
    enc = tiktoken.Encoding("nc", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={"<|bos|>": 256})
    (tmp_path / "tokenizer.pkl").write_bytes(pickle.dumps(enc))
    assert nanochat.read_tokenizer(tmp_path / "tokenizer.pkl").encode("hi <|bos|>", allowed_special="all") == \
        enc.encode("hi <|bos|>", allowed_special="all")
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(os.system))  # any other global: refused
    with pytest.raises(pickle.UnpicklingError):
        nanochat.read_tokenizer(tmp_path / "evil.pkl")


# ---- upstream nanochat 92d63d4 + the fork's Laplacian lines, beside ours -------------------------
NANOCHAT = os.environ.get("LAPLACE_NANOCHAT")


@pytest.fixture(scope="module")
def reference():
    """Upstream's nanochat.gpt, patched at run time with the fork's (yuchongzhang/nanochat 1f70b55)
    Laplacian lines: after attention, the last k heads output v - y, v after the value-embedding
    mix-in, repeated over the GQA groups (its gpt.py L137-141, here around upstream's attention call)."""
    sys.path.insert(0, NANOCHAT)
    import nanochat.gpt as ng

    attend, fwd, layer_k = ng.flash_attn.flash_attn_func, ng.CausalSelfAttention.forward, [0]

    def laplacian_attention(q, k, v, causal=False, window_size=(-1, -1)):
        y = attend(q, k, v, causal=causal, window_size=window_size)
        n_head, n_kv_head, n_laplacian_head = q.size(2), k.size(2), layer_k[0]
        n_vanilla_head = n_head - n_laplacian_head
        if n_laplacian_head > 0:  # the fork's lines
            v_current = v if n_head == n_kv_head else v.repeat_interleave(n_head // n_kv_head, dim=2)
            y_laplacian = v_current[:, :, n_vanilla_head:, :] - y[:, :, n_vanilla_head:, :]
            y = torch.cat([y[:, :, :n_vanilla_head, :], y_laplacian], dim=2)
        return y

    def forward(self, *args):
        layer_k[0] = self.n_laplacian_head
        return fwd(self, *args)

    ng.flash_attn.flash_attn_func, ng.CausalSelfAttention.forward = laplacian_attention, forward
    yield ng
    ng.flash_attn.flash_attn_func, ng.CausalSelfAttention.forward = attend, fwd
    sys.path.remove(NANOCHAT)


# The fork's switches as upstream values: a switched-off scalar is its neutral value there.
NEUTRAL = {"use_resid_lambdas": ("resid_lambdas", 1.0), "use_x0": ("x0_lambdas", 0.0),
           "use_smear": ("smear_lambda", 0.0), "use_backout": ("backout_lambda", 0.0)}
UPSTREAM_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern")
CASES = {"k0": dict(laplacian_heads=0), "k2": dict(laplacian_heads=2), "all": dict(laplacian_heads=4),
         "per-layer": dict(laplacian_heads=[0, 1, 2, 4]), "gqa": dict(laplacian_heads=2, n_kv_head=2),
         "long": dict(laplacian_heads=2, window_pattern="L"),
         **{s: {"laplacian_heads": 2, s: False} for s in nanochat.SWITCHES}}


@pytest.mark.skipif(not NANOCHAT, reason="LAPLACE_NANOCHAT=<karpathy/nanochat checkout at 92d63d4>")
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_the_fork(reference, tmp_path, case, monkeypatch):
    cfg = dict(sequence_len=SEQ, vocab_size=V, n_layer=4, n_head=4, n_kv_head=4, n_embd=128, window_pattern="SSSL")
    cfg.update(CASES[case])
    if not cfg.get("use_ve", True):
        monkeypatch.setattr(reference, "has_ve", lambda i, n: False)
    with torch.device("meta"):
        ref = reference.GPT(reference.GPTConfig(**{k: v for k, v in cfg.items() if k in UPSTREAM_KEYS}))
    ref.to_empty(device="cpu")
    ref.init_weights()
    randomize_(ref)
    ks = cfg["laplacian_heads"]
    for blk, k in zip(ref.transformer.h, ks if isinstance(ks, list) else [ks] * 4):
        blk.attn.n_laplacian_head = k
    sd = ref.state_dict()
    with torch.no_grad():
        for switch, (name, neutral) in NEUTRAL.items():
            if not cfg.get(switch, True):
                getattr(ref, name).fill_(neutral)  # upstream without it ...
                del sd[name]  # ... and the fork's checkpoint, which has no such parameter
    if not cfg.get("use_smear", True):
        del sd["smear_gate.weight"]
    torch.save(sd, tmp_path / "model_000001.pt")
    (tmp_path / "meta_000001.json").write_text(json.dumps({"model_config": cfg}))
    ours, idx = nanochat.load(tmp_path), tokens()
    with torch.no_grad():
        diff = (ref.eval()(idx) - ours(idx)).abs().max().item()
    print(f"[parity] {case}: max |logits - fork's| = {diff:.3g}")
    assert diff <= 1e-5
