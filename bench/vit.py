"""What Laplacian heads and their relatives cost, and our ViT against timm's (`python -m bench vit`).

Forward + backward of a whole ViT and of its first attention layer alone, for each family of
--families at k = 0, half and all heads Laplacian (`laplace.create_model("vits_{k}L")`), the other
arms at k = 0 (`attention=` xsa, gated, diff: laplace.attention.ARMS) and timm's DeiT-III of the same
shape (`timm.create_model("deit3_small_patch16_224")`). Time: the median and IQR of
torch.utils.benchmark.Timer; memory: the bytes autograd saves for backward. Each is divided by the
softmax k = 0 row and by timm's row of its family and part.
"""
import pandas as pd
import timm
import torch

import laplace
from laplace.attention import ARMS

from .gpt_memory import SavedBytes, in_turns, ratios, timer

TIMM = {"vits": "deit3_small_patch16_224", "vitb": "deit3_base_patch16_224"}
SMOKE = {"vits": dict(depth=1, embed_dim=48), "vitb": dict(depth=1, embed_dim=96)}  # the zoo's head counts


def models(family: str, args) -> dict:
    """{name: (k, attention, model)}: ours at k = 0, half and all heads, the other arms at k = 0, then
    timm's (k and attention None)."""
    size = dict(img_size=args.img_size, **(SMOKE[family] if args.smoke else {}))
    # The head count from timm's model of the family: k's range follows it (smoke keeps the zoo's).
    heads = timm.create_model(TIMM[family], **size).blocks[0].attn.num_heads
    ks = sorted({0, heads // 2, heads})
    out = {f"{family}_{k}L": (k, "softmax", laplace.create_model(f"{family}_{k}L", **size)) for k in ks}
    out.update({f"{family}_0L {arm}": (0, arm, laplace.create_model(f"{family}_0L", attention=arm, **size))
                for arm in ARMS[1:]})
    out[f"timm {TIMM[family]}"] = (None, None, timm.create_model(TIMM[family], **size))
    return out


def step(module, x, device: str):
    """Forward + backward of `module` on x (bf16 autocast on CUDA, as training runs there)."""
    def fn():
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=device != "cpu"):
            out = module(x)
        # A scalar from every output, so that backward runs through all of it; float32 as a
        # loss would be. Gradients accumulate between runs: one add per parameter, alike for all.
        out.float().sum().backward()
    return fn


def run(args) -> pd.DataFrame:
    cases = []  # (row, timer, saved-bytes probe)
    for family in args.families:
        for name, (k, arm, model) in models(family, args).items():
            model = model.to(args.device).train()
            images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=args.device)
            N, C = model.patch_embed.num_patches + 1, model.embed_dim  # + the class token
            tokens = torch.randn(args.batch_size, N, C, device=args.device, requires_grad=True)
            # Through the public builders only: a block's `.attn` is the layer in ours and timm's.
            for part, module, x in (("model", model, images), ("attention", model.blocks[0].attn, tokens)):
                # The model itself: torch.compile'd when --compile (after the attention is taken).
                net = torch.compile(module) if args.compile else module
                cases.append((dict(family=family, part=part, model=name, k=k, attention=arm),
                              timer(step(net, x, args.device), args), (module, step(module, x, args.device))))
    rows = []
    for (row, _, (module, fn)), m in zip(cases, in_turns([t for _, t, _ in cases], args, "vit")):
        with SavedBytes(module) as saved:  # eager, one more step: memory is not timed
            fn()
        rows.append(dict(row, ms=1e3 * m.median, iqr_ms=1e3 * m.iqr, runs=len(m.times),
                         saved_mib=saved.bytes / 2**20))
        print(f"[vit] {row['part']:9s} {row['model']:28s} {1e3 * m.median:9.2f} ms", flush=True)
    df = pd.DataFrame(rows)
    # Each row over its family and part's reference row: softmax k = 0 (the overhead of Laplacian heads
    # and of each arm) and timm's (ours vs timm).
    for label, ref in (("k=0", (df.k == 0) & (df.attention == "softmax")), ("timm", df.k.isna())):
        ratios(df, ref, ["family", "part"], "ms", "saved_mib", label)
    return df
