"""`python -m bench`: the one benchmark of the project, written as comparable records.

    python -m bench --threads 1                  # CPU defaults: a few minutes on 2 cores
    python -m bench --device cuda                # the GPU protocol (ViT-B 128 x 224, GPT d20 16 x 2048, bf16)
    python -m bench --device cuda --compile      # eager and torch.compile'd
    python -m bench --smoke --out /tmp/b         # everything tiny (CI, tests/test_bench.py)
    python -m bench --sections loader tokenizer  # the GPT data path alone
    python -m bench --sections analysis --analysis-tokens 100000   # the accumulator alone

A tool on the top floor (it times the library, the loop and the consumers): nothing below
imports it.

What it measures (--sections, default all):
    layer     one attention layer (laplace.attention.Attention) alone, forward + backward
    step      a whole training step: zero grads, forward, loss, backward, optimizer step
              (ViTs: AdamW from timm's factory as optim=adamw; GPT: Muon + AdamW from
              train.optim.build_muon_adamw with experiment=gpt_d20's composed optim node)
    loader    the LM loader (laplace.data.shards.TokenStream): tokens/s over random shards
    tokenizer BPE (laplace.tokenizer) trained on the built-in help text, then encode_batch
              tokens/s with 1, 2, ... threads
    analysis  analysis.streaming.GeometryAccumulator: update() tokens/s against the bare float64
              X^T X matmul of the same batches, and the peak memory at each N (a fresh process each)
for the families (--families) ViT-S (vits_0L / 3L / 6L vs timm deit3_small_patch16_224), ViT-B
(vitb_0L / 6L / 12L vs timm deit3_base_patch16_224) and GPT (gpt_d{depth}_0L / half / all), in
eager mode and, with --compile, compiled too. The table gives the ratios to k = 0 (target
<= 1.01 in time and memory) and to timm (target <= 1.00), each marked met / NOT met.

Timing: the models of one family, section and mode are stepped round-robin (the order rotated
every round), so drifts in machine load hit every model alike; the median and the minimum over
--steps timed steps after --warmup untimed ones. CUDA is synchronised around every timed step.
On CPU the process CPU time is recorded too: on a shared host other jobs inflate wall time far
more than CPU time (use --threads 1 there: idle OpenMP threads spin while waiting for a core).

Memory, on one untimed step per model (CPU eager: the first step; otherwise the second, after
compilation and with the optimizer state allocated):
    peak MB  - CUDA: torch.cuda.max_memory_allocated during the step minus what was allocated
               before it, gradients dropped: activations + gradients + workspace + optimizer
               temporaries. CPU ("RSS+"): the growth of the resident set size during the step,
               sampled every millisecond: rough (the allocator keeps freed memory, spikes
               between samples are missed); compare it only between models.
    saved MB - bytes of the tensors autograd saves for backward, deduplicated by storage and
               without the parameters: the activation memory, exact and allocator independent
               (under bf16 autocast it includes the bf16 weight copies; eager only).

Records: <out>/<date>_<cpu|cuda>_<GPU name | CPU model-cores>.json (every number, the machine,
the versions, the commit, the arguments) and .md (the tables, also printed); --out defaults to
docs/benchmarks.
"""
from .pipeline import analysis_one, bench_stream, bench_tokenizer  # light: numpy and torch only


def main(argv=None) -> dict:
    """Run the benchmark (argv: the command line's arguments); returns the record."""
    from .cli import main as _main

    return _main(argv)


__all__ = ["main", "analysis_one", "bench_stream", "bench_tokenizer"]
