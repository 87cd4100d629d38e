"""`python -m bench`: what Laplacian heads cost, our ViT against timm's, the GPT's memory against
nanochat's and one data-loader worker's images/s, written as a record (JSON + Markdown) to
docs/benchmarks/ (--out elsewhere).

    python -m bench                                # every section: a few minutes on 2 CPU cores
    python -m bench vit --device cuda --compile    # the ViT timings on a GPU, bf16 autocast
    python -m bench gpt_memory --nanochat DIR      # DIR holds karpathy/nanochat's nanochat/ (eec0c79)
    python -m bench --smoke --out /tmp/b           # everything tiny (tests/test_bench.py)

Sections: vit (bench/vit.py), gpt_memory (bench/gpt_memory.py), loader (bench/images.py); times from
torch.utils.benchmark.Timer, memory as the bytes autograd saves for backward. A tool on the top
floor: it times the library and the trainers' data, and nothing below imports it.
"""


from .cli import main  # noqa: E402,F401  (returns the record and its tables)
