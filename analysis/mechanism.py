"""Does each head smooth the residual stream? A per-layer, per-head diagnostic of the paper's
mechanism, in the frame of the geometry: the residual stream the block reads. `python -m analysis`
runs it with mechanism=true (the default): "mechanism" in analysis.json, mechanism.md and
mechanism.{png,pdf} in the analysis folder.

A block adds to its input stream x the term ls1(attn(norm1(x))). Head h's part of it is

    D_h = O_h diag(lambda),   O_h = (a V_h + (1 - 2a) P_h V_h) W_o,h     (a = 0 softmax, 1 Laplacian)

with V_h the values of the normed input and lambda the ViT's LayerScale (the GPT has none). A
Laplacian head gives O_h = -(P_h X~ - X~) W_v,h W_o,h with X~ ~ x Pi diag(g) / sigma (LayerNorm:
centring Pi, gain g, a positive per-token scale; the GPT's RMSNorm: none of Pi and g). So it
smooths the stream (moves each token toward its attention-weighted mean) when the symmetric part
of M_h = Pi diag(g) W_v,h W_o,h diag(lambda) (row vectors: x -> x M_h) is negative. Per head, on
the analysis' validation tokens (the ViT's patch tokens, the GPT's every position):

    cos_smooth   <D_h, P_h x - x> / (|D_h| |P_h x - x|), Frobenius over all tokens; > 0: smooths
    cos_token    the mean over tokens of the per-token cosine (tokens where either is 0 left out)
    dvar         first-order relative change of the within-sequence variance W if D_h alone were
                 added: 2 <x - mean_seq(x), D_h> / W; < 0: smooths
    dshare       first-order change of the within-sequence share W / T (T: about the mean of all tokens)
    dvar_exact   the exact relative change, (W(x + D_h) - W) / W = dvar + |D_h - mean_seq(D_h)|^2 / W:
                 the second-order term is never negative, and a head as large as the stream (out_norm
                 near 1; blocks move the GPT's stream by factors of 0.6 to 86) can turn a first-order
                 smoothing into an exact sharpening
    dshare_exact W(x + D_h) / T(x + D_h) - W / T, exactly
    out_norm     |D_h| / |x|: the head's scale relative to the stream, which says how far the first
                 order can be trusted
    neg_mass     sum |negative eigenvalues| / sum |eigenvalues| of sym(M_h); null 0.5: W_o -> -W_o
                 maps sym(M_h) to -sym(M_h) and neg_mass m to 1 - m, so a head whose distribution that
                 sign flip leaves unchanged (its random initialisation; a head training pushed neither
                 way) has mean 0.5. Counting eigenvalues does not give it (Sylvester: d of each sign
                 for a rank-d head, whatever their sizes): counts are not masses
    trace_fro    trace(M_h) / |M_h|_F; eig_min, eig_max; type, gate ("learned a=0.73", a)

The arms (laplace.attention.ARMS) are measured alike, O_h their head's exact term: XSA's P V less its
part along v, the gated arm's gate (the weight spectrum leaves it out: it is the input's). DIFF has no
single row-stochastic P: P_h is its signed map P1 - lambda P2 (rows sum to 1 - lambda) and O_h
includes its head norm, so its cosines measure the alignment with P_h x - x, not a move toward a
weighted mean; its dvar, dshare and out_norm are the head's own, as for any arm.
"""
import math
import statistics
import time
from pathlib import Path
from typing import Optional

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from laplace.attention import xsa
from laplace.vit import VisionTransformer
from laplace.zoo import features

TYPES = ("softmax", "laplacian", "learned", "xsa", "gated", "diff")  # a head's kind: its arm unless Laplacian
#: The per-head numbers pooled by `summary` (and read by analysis.runs as mechanism.<key>.<type>).
SUMMARY_KEYS = ("cos_smooth", "cos_token", "dvar", "dshare", "neg_mass", "trace_fro", "dvar_exact", "dshare_exact",
                "out_norm")
NULL_MASS = 0.5  # neg_mass of a head that the sign flip W_o -> -W_o leaves as likely (see above)


def head_type(a: float, mode: str, arm: str = "softmax") -> str:
    """ "laplacian" (fixed mode, a = 1) or the arm ("softmax", "xsa", ...; a = 0), "learned a=0.xx"."""
    if mode == "learned":
        return f"learned a={a:.2f}"
    return "laplacian" if a == 1.0 else arm


def stream_frame(block) -> dict:
    """How a block's attention reads and writes the stream: {gain, center, scale} (LayerNorm
    gain or None, whether the norm centres the features, LayerScale's gamma or None)."""
    norm, ls = getattr(block, "norm1", None), getattr(block, "ls1", None)
    # the norm's gain enters the head's read side, LayerScale its write side: without them the
    # eigen-mass is of W_v W_o alone (a toy moved 0.93 -> 0.77 with them, 0.50 with mixed-sign LayerScale)
    is_ln = isinstance(norm, nn.LayerNorm)  # the ViT (timm's LayerNorm too); the GPT: RMSNorm, no module
    gain = norm.weight.detach().double() if is_ln and norm.weight is not None else None
    scale = getattr(ls, "gamma", None)
    return {"gain": gain, "center": is_ln, "scale": None if scale is None else scale.detach().double()}


def _weights(attn) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(W_v [D, D] torch layout (out, in), b_v or None, W_o [D, D]) in float64."""
    D = attn.proj.weight.shape[0]
    w = attn.qkv.weight.detach().double()
    b = attn.qkv.bias
    return w[2 * D:3 * D], None if b is None else b.detach().double()[2 * D:3 * D], attn.proj.weight.detach().double()


def sym_eigenvalues(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The (up to 2 d) nonzero eigenvalues of Sym = (A B + (A B)^T) / 2, A [D, d], B [d, D], ascending.

    With U = [A, B^T] and J = [[0, I], [I, 0]], A B + B^T A^T = U J U^T, whose nonzero eigenvalues
    are those of G^1/2 J G^1/2 (G = U^T U, 2d x 2d): no D x D eigen-problem. J has d eigenvalues
    +1 and d -1, so (Sylvester) Sym has d positive and d negative ones when U has rank 2d."""
    U = torch.cat([A, B.T], dim=1)
    d = A.shape[1]
    g, Q = torch.linalg.eigh(U.T @ U)
    R = Q * g.clamp_min(0).sqrt()  # G^1/2 = R Q^T
    J = torch.eye(2 * d, dtype=A.dtype, device=A.device).roll(d, 0)  # [[0, I], [I, 0]]
    H = (R.T @ J @ R) / 2  # similar to G^1/2 J G^1/2 / 2 (conjugated by Q)
    e = torch.linalg.eigvalsh((H + H.T) / 2)
    # (a head that writes into the subspace it reads has U of rank d: then no eigenvalue need be positive)
    keep = e.abs() > 1e-10 * e.abs().max()  # U's rank may be below 2d (e.g. 2d > D): its zeros are not Sym's
    return e[keep] if keep.any() else e


def weight_spectrum(attn, gain=None, center: bool = False, scale=None) -> list[dict]:
    """Per head: neg_mass, trace_fro, eig_min, eig_max of the stream-frame M_h (module docstring)."""
    Wv, _, Wo = _weights(attn)
    D, dh = Wo.shape[0], Wo.shape[0] // attn.num_heads  # a head's value width (DIFF's head_dim is half)
    read = torch.eye(D, dtype=Wv.dtype, device=Wv.device)
    if center:  # LayerNorm subtracts each token's feature mean: Pi = I - 1 1^T / D
        read = read - 1.0 / D
    if gain is not None:
        # (row vectors: x Pi diag(g) scales the columns of Pi)
        read = read * gain.to(read)  # Pi diag(g)
    write = torch.ones(D, dtype=Wv.dtype, device=Wv.device) if scale is None else scale.to(Wv)
    out = []
    for h in range(attn.num_heads):
        A = read @ Wv[h * dh:(h + 1) * dh].T  # [D, dh]: v = x A
        B = Wo[:, h * dh:(h + 1) * dh].T * write  # [dh, D]: its part of the stream = y B
        e = sym_eigenvalues(A, B)
        M = A @ B
        fro, total = M.norm().item(), e.abs().sum().item()
        out.append({"neg_mass": (e.clamp_max(0).abs().sum().item() / total) if total > 0 else float("nan"),
                    "trace_fro": M.trace().item() / fro if fro > 0 else float("nan"),
                    "eig_min": e.min().item(), "eig_max": e.max().item()})
    return out


def head_outputs(attn, x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """O [B, H, N, D] in float64: every head's term of attn(x) given its P [B, H, N, N]
    (sum over heads + attn.proj.bias = the module's output)."""
    B, N, D = x.shape
    H, dh = attn.num_heads, D // attn.num_heads  # a head's value width (DIFF's head_dim is half of it)
    Wv, bv, Wo = _weights(attn)
    v = x.double() @ Wv.T
    if bv is not None:
        v = v + bv
    v = v.view(B, N, H, dh).transpose(1, 2)  # [B, H, N, dh]
    pv = P.double() @ v
    a = attn.gates().detach().double().view(1, H, 1, 1)
    # the gate a mixes the two kinds of head: a = 0 a softmax head (PV), a = 1 a Laplacian one (V - PV)
    y = a * v + (1 - 2 * a) * pv  # (1 - a) PV + a (V - PV)
    if attn.attention == "xsa":
        y = xsa(y, v)
    elif attn.attention == "diff":  # P: DIFF's signed map; then its head norm and scale (timm's DiffAttention)
        y = F.rms_norm(pv, (dh,), attn.sub_norm.weight.double(), eps=attn.sub_norm.eps) * (1 - attn.lambda_init)
    if getattr(attn, "gate", None) is not None:  # the gated arm: sigmoid(x W_g + b_g) per head channel
        g = F.linear(x.double(), *(None if t is None else t.detach().double() for t in (attn.gate.weight, attn.gate.bias)))
        y = y * g.sigmoid().view(B, N, H, dh).transpose(1, 2)
    return torch.einsum("bhnd,ehd->bhne", y, Wo.view(D, H, dh))


class HeadAccumulator:
    """The data part of one attention layer's per-head numbers, folded batch by batch (float64).

    Args:
        attn: the layer's attention module.
        frame: `stream_frame` of its block (default: no norm gain, no LayerScale: the stream is
            the attention's input, as for a bare attention module).
        skip: leading tokens left out of the sums (the ViT's class token: its geometry is of the
            patch tokens).
    """

    #: float64 elements of one chunk's largest tensor ([b, H, N, max(N, D)]): about 256 MiB
    CHUNK_ELEMENTS = 2 ** 25

    def __init__(self, attn, frame: Optional[dict] = None, skip: int = 0):
        # The sums live on the attention's device: no host sync per batch, one in compute().
        dev = attn.proj.weight.device
        z = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=dev)  # noqa: E731
        self.attn, self.frame, self.skip = attn, frame or {"gain": None, "center": False, "scale": None}, skip
        H, D = attn.num_heads, attn.proj.weight.shape[0]
        self.os, self.oo, self.ss, self.cos_sum, self.cos_n, self.xc_o, self.x_o = (z(H) for _ in range(7))
        self.o_sum = z(H, D)  # sum over tokens of each head's D_h: its part of <mean(x), D_h>
        self.oo_seq = z(H)  # sum over sequences of |sum_n D_h|^2 / N: |D_h|^2 less its within-sequence part
        self.x_sum, self.xx, self.wx, self._err = z(D), z(), z(), z()
        self.sequences = self.tokens = 0

    @property
    def recon_err(self) -> float:
        """The largest relative deviation of the heads' sum from the module's output seen."""
        return self._err.item()

    @torch.no_grad()
    def update(self, stream: torch.Tensor, x: torch.Tensor, P: torch.Tensor, out: Optional[torch.Tensor] = None):
        """stream [B, N, D] the block's input (the residual stream), x [B, N, D] the attention's
        input (normed), P [B, H, N, N] its heads' matrices, out (optional) its output, checked
        against the heads' sum (recon_err). Folded in chunks of sequences (CHUNK_ELEMENTS)."""
        B, N, D = x.shape
        # whole sequences per chunk: each sequence's mean is part of the within-sequence terms
        step = max(1, self.CHUNK_ELEMENTS // (self.attn.num_heads * N * max(N, D)))
        for i in range(0, B, step):
            self._update(stream[i:i + step], x[i:i + step], P[i:i + step], None if out is None else out[i:i + step])

    def _update(self, stream, x, P, out):
        s64, P64 = stream.double(), P.double()
        O = head_outputs(self.attn, x.double(), P64)
        if out is not None:
            bias = self.attn.proj.bias
            full = O.sum(1) + (0 if bias is None else bias.double())
            # the heads' parts must sum to what the module computed: a check that O_h is the head's term
            err = (full - out.double()).norm() / out.double().norm().clamp_min(1e-30)
            self._err = torch.maximum(self._err, err)
        if self.frame["scale"] is not None:
            O = O * self.frame["scale"].to(O)  # LayerScale: the head's part as it enters the stream
        S = P64 @ s64[:, None]
        S -= s64[:, None]  # [B, H, N, D]: P x - x, the smoothing direction of the stream
        k = self.skip
        O, S, s64 = O[:, :, k:], S[:, :, k:], s64[:, k:]
        ip, oo, ss = (O * S).sum(-1), (O * O).sum(-1), (S * S).sum(-1)  # [B, H, N]
        del S
        self.os += ip.sum((0, 2))
        self.oo += oo.sum((0, 2))
        self.ss += ss.sum((0, 2))
        # per-token cosines where both vectors are nonzero (a GPT's first position attends only to itself)
        prod = oo * ss
        ok = prod > 1e-300
        self.cos_sum += torch.where(ok, ip / prod.clamp_min(1e-300).sqrt(), 0).sum((0, 2))
        self.cos_n += ok.sum((0, 2)).double()
        # first order: dW = 2 <x_c, D> (x_c: x less its sequence's mean), dT = 2 <x - mean(x), D>;
        # the mean over all tokens is known at the end only, so <x, D> and sum D are kept apart
        xc = s64 - s64.mean(1, keepdim=True)
        self.xc_o += torch.einsum("bnd,bhnd->h", xc, O)
        self.x_o += torch.einsum("bnd,bhnd->h", s64, O)
        # (<x - mean, D> = <x, D> - mean . sum D: the mean over all tokens is known at the end only)
        self.o_sum += O.sum((0, 2))
        # the exact terms' |D - mean_seq(D)|^2 = |D|^2 - N |mean_seq(D)|^2, summed: the second order
        self.oo_seq += (O.sum(2) ** 2).sum((0, 2)) / O.shape[2]
        self.x_sum += s64.sum((0, 1))
        self.wx += (xc * xc).sum()
        self.xx += (s64 * s64).sum()
        self.sequences += x.shape[0]
        self.tokens += s64.shape[0] * s64.shape[1]

    def compute(self) -> list[dict]:
        """Per head: the data numbers (module docstring) + `weight_spectrum`'s + type, gate."""
        attn = self.attn
        gates = attn.gates().detach().float().cpu().tolist()
        nan = float("nan")
        os, oo, ss, cos_sum, cos_n, xc_o, oo_seq = (t.tolist() for t in (self.os, self.oo, self.ss, self.cos_sum,
                                                                         self.cos_n, self.xc_o, self.oo_seq))
        mean = self.x_sum / max(self.tokens, 1)
        xm_o = (self.x_o - self.o_sum @ mean).tolist()  # <x - mean(x), D_h>
        W, X = self.wx.item(), self.xx.item()
        # share = W / T, so d share = share (dW / W - dT / T) to first order
        T = X - self.tokens * (mean @ mean).item()  # the total sum of squares about the mean
        # exactly, with D_h added: W' = W + 2 <x_c, D> + |D_c|^2 (D_c: D less its sequence's mean) and
        # T' = T + 2 <x - mean, D> + |D - mean(D)|^2 (the mean over all tokens)
        W2 = [W + 2 * xc_o[h] + oo[h] - oo_seq[h] for h in range(attn.num_heads)]
        o_mean = (self.o_sum ** 2).sum(1) / max(self.tokens, 1)
        T2 = [T + 2 * xm_o[h] + oo[h] - o_mean[h].item() for h in range(attn.num_heads)]
        heads = []
        for h, spec in enumerate(weight_spectrum(attn, **self.frame)):
            den = math.sqrt(oo[h] * ss[h])
            dvar = 2 * xc_o[h] / W if W > 0 else nan
            heads.append({
                "head": h, "type": head_type(gates[h], attn.laplacian_mode, attn.attention), "gate": gates[h],
                "cos_smooth": os[h] / den if den > 0 else nan,
                "cos_token": cos_sum[h] / cos_n[h] if cos_n[h] > 0 else nan,
                "dvar": dvar, "dshare": W / T * (dvar - 2 * xm_o[h] / T) if W > 0 and T > 0 else nan,
                "out_norm": math.sqrt(oo[h] / X) if X > 0 else nan,
                "dvar_exact": (W2[h] - W) / W if W > 0 else nan,
                "dshare_exact": W2[h] / T2[h] - W / T if T > 0 and T2[h] > 0 else nan,
                **spec})
        return heads


def summary(heads: dict[str, list[dict]]) -> dict:
    """Means of SUMMARY_KEYS over the heads of each type group (softmax, laplacian, learned):
    {"<key>.<group>": mean over all layers, "blocks.<i>": {"<key>.<group>": mean in that layer}}."""
    # a head's type is its group, but for the learned ones ("learned a=0.73" -> learned)
    rows = pd.DataFrame([{"layer": layer, "group": h["type"].split(" ")[0], "key": k, "value": h[k]}
                         for layer, hs in heads.items() for h in hs for k in SUMMARY_KEYS if k in h],
                        columns=["layer", "group", "key", "value"])
    # a head whose number is NaN (e.g. an all-zero output) is left out of its type's mean; fmean: exact sums
    rows = rows[rows["value"].map(math.isfinite)]

    def pool(part):
        means = part.groupby(["key", "group"], sort=False)["value"].agg(statistics.fmean)
        return {f"{k}.{g}": v for (k, g), v in means.items()}

    return {**pool(rows), **{layer: pool(part) for layer, part in rows.groupby("layer", sort=False)}}


@torch.no_grad()
def mechanism_model(model, dataset, batch_size: int = 64, num_workers: int = 0, progress: bool = False) -> dict:
    """Measure every head of every block on `dataset` (items (image, class) or (window, next
    tokens), e.g. `eval_split`'s): what analysis.json holds as "mechanism": heads
    ({"blocks.<i>": [per-head dict, see the module docstring]}), their summary, the counts, the
    largest relative deviation of the heads' sum from the attention's output (recon_err) and time."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    # the geometry's ViT ANOVA is of the patch tokens: the mechanism leaves out the class token too
    skip = 1 if isinstance(model, VisionTransformer) else 0
    accs = [HeadAccumulator(blk.attn, stream_frame(blk), skip) for blk in model.blocks]
    streams = {}  # each block's input: the residual stream its attention's part is added to

    def ask(module, args, kwargs):  # the reference path forms P only when asked
        return args, {**kwargs, "return_attn": True}

    def fold(module, args, output, i):  # the block gets its usual output; its own code runs unchanged
        out, P = output
        accs[i].update(streams.pop(i), args[0], P, out)
        return out

    handles = []
    for i, blk in enumerate(model.blocks):  # i=i: each hook keeps its own block's index
        handles += [blk.register_forward_pre_hook(lambda m, args, i=i: streams.__setitem__(i, args[0])),
                    blk.attn.register_forward_pre_hook(ask, with_kwargs=True),
                    blk.attn.register_forward_hook(lambda m, args, output, i=i: fold(m, args, output, i))]
    try:
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
        for x, _ in tqdm(loader, desc="mechanism", disable=not progress, leave=False):
            features(model, x.to(dev), norm=False)  # the final norm is not needed
    finally:
        for h in handles:
            h.remove()
    heads = {f"blocks.{i}": acc.compute() for i, acc in enumerate(accs)}
    return {"heads": heads, "summary": summary(heads), "n_sequences": accs[0].sequences, "n_tokens": accs[0].tokens,
            "recon_err": max(a.recon_err for a in accs), "seconds": time.perf_counter() - t0,
            "batch_size": batch_size, "frame": "stream"}


# ----------------------------------------------------------------------------- outputs

# Columns of the per-head table and their formats.
_COLUMNS = {"cos_smooth": "+.3f", "cos_token": "+.3f", "dvar": "+.4f", "dshare": "+.4f", "neg_mass": ".3f",
            "trace_fro": "+.3f", "eig_min": "+.3g", "eig_max": "+.3g", "out_norm": ".3g", "dvar_exact": "+.4f",
            "dshare_exact": "+.4f"}


def _heads_frame(heads: dict) -> pd.DataFrame:
    """A row per head: layer, head, type, gate and its numbers (NaN where a head lacks one)."""
    return pd.DataFrame([{"layer": layer, **h} for layer, hs in heads.items() for h in hs]).reindex(
        columns=["layer", "head", "type", "gate", *_COLUMNS])


def to_markdown(result: dict) -> str:
    """The per-head table and the means per type of a `mechanism_model` result."""
    def fmt(v, f):
        return "nan" if not math.isfinite(v) else format(v, f)

    heads = _heads_frame(result["heads"]).drop(columns="gate")
    for k, f in _COLUMNS.items():
        heads[k] = heads[k].map(lambda v, f=f: fmt(v, f))
    s = result.get("summary") or summary(result["heads"])
    means = pd.DataFrame([{"type": g, **{k: fmt(s.get(f"{k}.{g}", math.nan), "+.4f") for k in SUMMARY_KEYS}}
                          for g in TYPES if f"cos_smooth.{g}" in s])
    return "\n".join([
        f"# Mechanism: does each head smooth the residual stream? ({result.get('model', 'model')})", "",
        f"{result.get('n_sequences', '?')} sequences, {result.get('n_tokens', '?')} tokens, in the stream's frame "
        "(a head's output after LayerScale; its matrix Pi diag(g) W_v W_o diag(lambda) with the norm's centring "
        "and gain). cos_smooth: Frobenius cosine of the head's part of the stream with P x - x (> 0: toward the "
        "attention-weighted mean); dvar / dshare: the first-order change of the within-sequence variance "
        "(relative) / share if the head's part alone were added (< 0: smooths), dvar_exact / dshare_exact the "
        "exact ones (with the |D|^2 term), out_norm |D| / |x|; neg_mass: the negative share of sym(M)'s "
        f"eigen-mass, null {NULL_MASS} (W_o -> -W_o maps it to 1 - neg_mass); trace_fro: trace(M) / |M|_F.", "",
        heads.to_markdown(index=False, disable_numparse=True), "",
        "Means over the heads of each type (all layers):", "",
        means.to_markdown(index=False, disable_numparse=True) if len(means) else "(no heads)", ""])


def draw_mechanism(result: dict, stem: Path) -> list[Path]:
    """Heatmaps layer x head of cos_smooth, dvar, dshare and the negative eigen-mass, Laplacian heads
    outlined (learned: a > 0.5); writes stem.{png,pdf} and returns the paths."""
    import numpy as np
    from matplotlib.patches import Rectangle

    from analysis.figures import plt, save

    df = _heads_frame(result["heads"])
    layers = list(result["heads"])
    grid = {k: df.pivot(index="layer", columns="head", values=k).reindex(layers).to_numpy(dtype=float)
            for k in ("cos_smooth", "dvar", "dshare", "neg_mass")}
    H = grid["dvar"].shape[1]
    # symmetric colour limits: 0 (neither smooths nor sharpens) is white
    lim = {k: (np.nanmax(np.abs(grid[k])) if np.isfinite(grid[k]).any() else 1.0) for k in ("dvar", "dshare")}
    panels = (("cos_smooth", "cos(head's part, Px - x)\n> 0: smooths", "RdBu", -1, 1),
              ("dvar", "d within-seq. variance (rel.)\n< 0: smooths", "RdBu_r", -lim["dvar"], lim["dvar"]),
              ("dshare", "d within-seq. share\n< 0: smooths", "RdBu_r", -lim["dshare"], lim["dshare"]),
              ("neg_mass", f"negative eigen-mass of sym(M)\nnull {NULL_MASS}", "RdBu", 0, 1))
    fig, axes = plt.subplots(1, 4, figsize=(4 * max(2.3, 0.6 * H + 1.2), max(2.2, 0.45 * len(layers) + 1.4)),
                             squeeze=False)
    outlined = df[(df["type"] == "laplacian") | (df["type"].str.startswith("learned") & (df["gate"] > 0.5))]
    for ax, (key, title, cmap, lo, hi) in zip(axes[0], panels):
        fig.colorbar(ax.imshow(grid[key], cmap=cmap, vmin=lo, vmax=hi, aspect="auto"), ax=ax, shrink=0.8)
        for (i, h), v in np.ndenumerate(grid[key]):
            ax.text(h, i, f"{v:.2g}", ha="center", va="center", fontsize=6)  # by magnitude: -3e-05, not -0.00
        for layer, h in zip(outlined["layer"], outlined["head"]):
            ax.add_patch(Rectangle((h - 0.5, layers.index(layer) - 0.5), 1, 1, fill=False, ec="k", lw=1.8))
        ax.set_xticks(range(H))
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_xlabel("head", fontsize=8)
        ax.set_title(title, fontsize=8)
    fig.suptitle(f"{result.get('model', '')}: per-head smoothing of the residual stream (outlined: Laplacian heads, "
                 "learned: gate a > 0.5)", fontsize=9)
    fig.tight_layout()
    return save(fig, stem)
