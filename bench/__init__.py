"""`python -m bench`: the one benchmark of the project, written as comparable records.

    python -m bench --threads 1                  # CPU defaults: a few minutes on 2 cores
    python -m bench --device cuda                # the GPU protocol (ViT-B 128 x 224, GPT d20 16 x 2048, bf16)
    python -m bench --smoke --out /tmp/b         # everything tiny (CI, tests/test_bench.py)

Sections (--sections): one attention layer and a whole training step of ViT-S, ViT-B and the GPT
at k = 0, half and all Laplacian heads against timm (models.py, timed and probed for memory by
timing.py), the GPT's saved bytes per token beside nanochat's own gpt.py (gpt_memory.py), the LM
loader and the tokenizer (pipeline.py), one data-loader worker's images/s on each image input path
(images.py), the analysis accumulator (pipeline.py,
a fresh process per size). report.py turns a run into its JSON and Markdown record. What each
number means, and how it is measured: README, "Benchmark". A tool on the top floor: it times the
library, the loop and the consumers, and nothing below imports it.
"""
from .pipeline import analysis_one, bench_stream, bench_tokenizer  # light: numpy and torch only


def main(argv=None) -> dict:
    """Run the benchmark (argv: the command line's arguments); returns the record."""
    from .cli import main as _main

    return _main(argv)


__all__ = ["main", "analysis_one", "bench_stream", "bench_tokenizer"]
