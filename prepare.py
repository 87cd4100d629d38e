"""Make the GPT's tokenizer and token shards from a text source (Hydra entry point).

    python prepare.py source=pydoc vocab_size=4096                      # the built-in text, seconds
    python prepare.py source=/data/fineweb-edu-100b-shuffle name=fineweb_edu

Every default: configs/prepare.yaml; the library: laplace/data/prepare/; the manual (sources,
outputs, resuming): docs/text_data.md. A step of the pipeline beside train.py, at the repository
root where configs/ is, so the library never reaches for a folder outside its package.
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from laplace.data.prepare import prepare
from laplace.errors import cli_errors


@hydra.main(version_base="1.3", config_path="configs", config_name="prepare")
def main(cfg: DictConfig) -> None:
    # Bad input: one `error:` line (HYDRA_FULL_ERROR=1: traceback); a bug: its traceback.
    cli_errors(prepare)(cfg)


if __name__ == "__main__":
    main()
