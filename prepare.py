"""Make the GPT's tokenizer and token shards from a text source (Hydra entry point).

    python prepare.py source=pydoc vocab_size=4096                      # the built-in text, seconds
    python prepare.py source=/data/fineweb-edu-100b-shuffle name=fineweb_edu

Every default: configs/prepare.yaml; the library: laplace/data/prepare/; the manual (sources,
outputs, resuming): docs/text_data.md. A step of the pipeline beside train.py (a command, not library code).
"""
from __future__ import annotations

from train.cli import hydra_entry
from laplace.data.prepare import prepare

main = hydra_entry("prepare")(prepare)


if __name__ == "__main__":
    main()
