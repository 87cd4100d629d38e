"""`trainer=lora`: LoRA fine-tuning of a GPT through peft, the authors' protocol (their nanochat fork,
scripts/lora_sft.py at 2dcfe0d): a frozen pre-trained base, adapters on every block's matrices.

    python train.py experiment=gpt26_d30_lora_sft model=gpt26_d30_3L trainer.base=<pretrain_run>/ckpt/last.pt

The model trained is peft's wrapper of the GPT; a checkpoint's "model" is the merged GPT
(`merge_and_unload`: what load_model, the evaluations and exports read) and its "train_model" holds
the adapters only, so the base weights are never stored twice: a resumed run reads them again from
trainer.base. Recipe: configs/experiment/gpt26_d30_lora_sft.yaml.
"""
import copy

from laplace.pretrained import load_pretrained

from .gpt import GPTTrainer


class LoRATrainer(GPTTrainer):
    def build_model(self):
        from peft import LoraConfig, get_peft_model

        model = super().build_model()
        tc = self.cfg.trainer
        if not next(model.parameters()).is_meta:  # a recipe card builds on meta and reads no weights
            # every run, resumed ones too: the frozen base is not in our checkpoints
            load_pretrained(model, tc.base, self.cfg.model, "auto")
        lo = tc.lora
        # peft freezes everything but the adapters (A random, B zero: the first step starts from the base)
        model = get_peft_model(model, LoraConfig(r=lo.rank, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
                                                 target_modules=list(lo.target_modules)))
        # The module trained is stored as the adapters alone (the engine's "train_model", what resume
        # loads, strictly): its base is trainer.base, read again by every run.
        model.register_state_dict_post_hook(_adapters_only)
        model.register_load_state_dict_post_hook(_base_not_missing)
        return model

    @property
    def exported(self):
        """The GPT with the adapters merged into its weights, computed once per step."""
        if getattr(self, "_merged", (None,))[0] != getattr(self, "step", None):
            self._merged = (getattr(self, "step", None), copy.deepcopy(self.model).merge_and_unload())
        return self._merged[1]


def _adapters_only(module, state, prefix, local_metadata):
    for k in [k for k in state if "lora_" not in k]:
        del state[k]


def _base_not_missing(module, incompatible):
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if "lora_" in k]
