"""lm-evaluation-harness (lm-eval 0.4.13) for our GPT checkpoints: the model "laplace".

lm-eval finds out-of-tree models only through `register_model` run in its own process, so
importing this module registers `LaplaceLM`, and `python -m eval.lm_adapter` is lm-eval's own
command line with the model registered. `python -m eval.lm` drives it for the paper's protocol.
The manual (arguments, how each request type is scored, several GPUs): docs/lm_adapter.md.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import sys
from collections.abc import Sequence

if __name__ == "__main__":
    # `python -m eval.lm_adapter` runs this file as __main__: make `import eval.lm_adapter` return
    # this module, so the "laplace" model is registered once, by one class.
    sys.modules.setdefault("eval.lm_adapter", sys.modules[__name__])

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from laplace import dist
from laplace.chat_format import render_conversation, render_for_completion
from laplace.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from laplace.errors import ConfigError
from laplace.gpt import GPT
from laplace.sampling import Calculator, stream_tokens
from laplace.tokenizer import tokenizer_from_config
from laplace.zoo import model_label

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_DEFAULT_BATCH = 8

# One scored request: ((context, continuation) strings or None for a rolling window,
# context ids, continuation ids).
Pair = tuple[tuple[str, str] | None, list[int], list[int]]


def _batch_size(value) -> int:
    if isinstance(value, str) and value.startswith("auto"):
        log.info("laplace: batch_size=%s: no batch-size search, using %d", value, _DEFAULT_BATCH)
        return _DEFAULT_BATCH
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ConfigError(f"batch_size={value!r}: use a positive integer")
    return n


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@register_model("laplace")
class LaplaceLM(LM):
    """A laplace GPT checkpoint as an lm-eval model (see the module docstring)."""

    def __init__(self, checkpoint: str, device: str = "auto", dtype: str = "auto",
                 batch_size: int | str = _DEFAULT_BATCH, max_length: int | None = None,
                 max_gen_toks: int = 256, seed: int = 1234, max_batch_size: int | None = None):
        super().__init__()
        del max_batch_size  # lm-eval passes it for batch_size=auto; there is no search here
        device = str(device)
        if dist._env_ranks()[1] > 1 and device.startswith("cuda"):
            device = "cuda"  # one GPU per process, the local rank's (the CLI's default is cuda:0)
        info = dist.setup(device)  # one process: the device; under torchrun: the group too
        self._rank, self._world_size, self._device = info.rank, info.world_size, info.device
        if info.distributed:
            atexit.register(dist.cleanup)
        ckpt = load_checkpoint(checkpoint)
        cfg = ckpt["config"]
        # eval.generate.load_generator_model's steps, on the checkpoint read once: its config
        # (the training context) and git revision are needed too, and d20 files are large.
        self.model: GPT = model_from_checkpoint(ckpt, self._device)
        if not isinstance(self.model, GPT):
            raise CheckpointError(f"checkpoint={checkpoint} holds {model_label(cfg['model'])}, not a GPT: "
                                  f"lm-eval needs a language model")
        self.tok = tokenizer_from_config(cfg)
        self.checkpoint, self.git_rev = str(checkpoint), ckpt.get("git_rev", "unknown")
        del ckpt

        dtype = str(dtype).lower()
        if dtype == "auto":
            dtype = "bfloat16" if self._device.type == "cuda" else "float32"
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype={dtype}: choose auto, {', '.join(_DTYPES)}")
        self._amp_dtype = _DTYPES[dtype]

        data_cfg = cfg.get("data") or {}
        self._max_length = int(max_length or data_cfg.get("seq_len") or cfg["model"].get("max_seq_len")
                               or 2048)
        if self._max_length > self.model.rope_len:
            raise ConfigError(f"max_length={self._max_length} exceeds the model's rotary table "
                              f"({self.model.rope_len} positions)")
        self._max_gen_toks = int(max_gen_toks)
        self._batch_size = _batch_size(batch_size)
        self.seed = int(seed)
        self.bos_id = self.tok.bos_id
        specials = self.tok.special_tokens
        self.stop_ids = frozenset(i for i in (self.bos_id, specials.get("<|assistant_end|>"))
                                  if i is not None and i < self.model.vocab_size)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """What simple_evaluate / the CLI call: `arg_dict` (--model_args) wins over
        `additional_config` (their batch_size, max_batch_size and device)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ---- properties lm-eval reads --------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @functools.cached_property
    def tokenizer_name(self) -> str:
        """Names the tokenizer in lm-eval's request-cache keys: kind + fingerprint."""
        return f"laplace-{self.tok.kind}-{self.tok.fingerprint()[:16]}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """A description of the chat format, for lm-eval's logged config (rendering is done by
        `apply_chat_template`, not by a Jinja template)."""
        return ("laplace.chat_format (nanochat): <|bos|><|user_start|>{system\\n\\n}{user}<|user_end|>"
                "<|assistant_start|>{assistant}<|assistant_end|>...<|assistant_start|>")

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(self._amp_dtype), "checkpoint": self.checkpoint,
                "checkpoint_git_rev": self.git_rev, "max_length": self.max_length}

    # ---- data parallelism (lm-eval's evaluator calls these when world_size > 1) ----------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size <= 1:
            return tensor
        t = tensor.reshape(1) if tensor.dim() == 0 else tensor
        out = [torch.empty_like(t) for _ in range(self._world_size)]
        torch.distributed.all_gather(out, t.contiguous())
        return torch.cat(out)

    def gather_object(self, obj, dst: int = 0):
        if self._world_size <= 1:
            return [obj]
        result = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj, result, dst=dst)
        return result

    def barrier(self) -> None:
        dist.barrier()

    # ---- tokens ----------------------------------------------------------------------------------
    def tok_encode(self, text: str) -> list[int]:
        """Ids of `text` with special-token strings as their ids, `<|bos|>` first (added unless the
        text starts with it)."""
        ids = self.tok.encode_with_specials(text)
        return ids if ids[:1] == [self.bos_id] else [self.bos_id, *ids]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        cont = whole[len(ctx):]
        if not cont and continuation:  # merged into the context's last token: split where they differ
            n = max(1, min(_common_prefix(ctx, whole), len(whole) - 1))
            ctx, cont = whole[:n], whole[n:]
        return ctx, cont

    def _amp(self):
        if self._amp_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, dtype=self._amp_dtype)

    # ---- loglikelihood ---------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [(tuple(r.args), *self._encode_pair(*r.args)) for r in requests]
        return self._loglikelihood_tokens(pairs, disable_tqdm=disable_tqdm)

    @torch.inference_mode()
    def _loglikelihood_tokens(self, pairs: list[Pair], disable_tqdm: bool = False,
                              cache_hook: bool = True) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, is_greedy) of each (strings, ctx ids, cont ids), in
        order: sorted longest first into batches, one forward per batch."""
        def sort_key(p):
            toks = p[1] + p[2]
            return -len(toks), tuple(toks)

        for strings, _, cont in pairs:
            if len(cont) > self.max_length:
                raise ConfigError(f"a continuation of {len(cont)} tokens exceeds max_length="
                                  f"{self.max_length}: it cannot be scored in one window "
                                  f"(continuation starts {strings[1][:40]!r})")
        empty = {i for i, p in enumerate(pairs) if not p[2]}  # log P(nothing) = 0
        todo = [p for i, p in enumerate(pairs) if i not in empty]
        re_ord = Collator(todo, sort_fn=sort_key, group_by="contexts",
                          group_fn=lambda p: p[1] + p[2][:-1])
        res = []
        pbar = tqdm(total=len(todo), disable=disable_tqdm or self._rank != 0,
                    desc="laplace: loglikelihood requests")
        for chunk in re_ord.get_batched(n=self.batch_size):
            inps = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]
            width = max(len(x) for x in inps)
            batch = torch.tensor([x + [0] * (width - len(x)) for x in inps], dtype=torch.long,
                                 device=self._device)  # right padding: after every scored position
            with self._amp():
                logits = self.model(batch)
            found = []  # (request strings, log-prob sum, is_greedy) as device scalars
            for (strings, ctx, cont), x, row_logits in zip(chunk, inps, logits):
                # the positions that predict the group's longest continuation
                span = row_logits[len(x) - len(cont):len(x)].float().log_softmax(dim=-1)
                for strs, cont_i, lp in re_ord.get_cache(req_str=strings, cxt_toks=ctx,
                                                          cont_toks=cont, logits=span.unsqueeze(0)):
                    lp = lp[0, -len(cont_i):]  # a shorter continuation of the group: its last positions
                    target = torch.tensor(cont_i, dtype=torch.long, device=self._device)
                    found.append((strs, lp.gather(1, target[:, None]).sum(),
                                  (lp.argmax(dim=-1) == target).all()))
            sums = torch.stack([f[1] for f in found]).tolist()  # one host sync per batch
            greedy = torch.stack([f[2] for f in found]).tolist()
            for (strs, _, _), lp_sum, is_greedy in zip(found, sums, greedy):
                answer = (float(lp_sum), bool(is_greedy))
                res.append(answer)
                if cache_hook and strs is not None:
                    self.cache_hook.add_partial("loglikelihood", strs, answer)
            pbar.update(len(found))
        pbar.close()
        scored = iter(re_ord.get_original(res))
        out = []
        for i, p in enumerate(pairs):
            out.append((0.0, True) if i in empty else next(scored))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows: list[Pair] = []
        owner: list[int] = []
        for k, r in enumerate(requests):
            ids = self.tok.encode_with_specials(r.args[0])
            if ids[:1] == [self.bos_id]:
                ids = ids[1:]  # the prefix token is the bos
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=self.bos_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (lp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm, False)):
            totals[k] += lp
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(r.args), total)
        return totals

    # ---- generation ------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        gen = torch.Generator(device=self._device).manual_seed(self.seed)
        for r in tqdm(requests, disable=disable_tqdm or self._rank != 0,
                      desc="laplace: generate_until requests"):
            context, gen_kwargs = r.args
            text = self._generate(context, gen_kwargs, gen)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _generate(self, context: str, gen_kwargs: dict, gen: torch.Generator) -> str:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
        max_gen = int(kwargs.pop("max_gen_toks"))
        temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
        top_k = kwargs.get("top_k") or None
        # generation_kwargs `tools: calculator` (laplace_chat_gsm8k): nanochat's calculator runs
        # the model's <|python_start|> ... <|python_end|> calls during generation.
        tool = kwargs.pop("tools", None)
        if tool not in (None, "calculator"):
            raise ConfigError(f"generation_kwargs.tools={tool!r}: the only tool is calculator")
        tools = Calculator(self.tok) if tool == "calculator" else None
        room = min(self.max_length, self.model.rope_len - max_gen)
        if room < 1:
            raise ConfigError(f"max_gen_toks={max_gen} leaves no room for a prompt in the model's "
                              f"rotary table ({self.model.rope_len} positions)")
        ids = self.tok_encode(context)[-room:]
        new: list[int] = []
        text = ""
        longest = max((len(s) for s in until), default=0)
        with self._amp():
            for t in stream_tokens(self.model, ids, max_gen, temperature, top_k, self.stop_ids, gen, tools):
                new.append(t)
                if until:
                    before = len(text)
                    text = self.tok.decode(new)
                    tail = text[max(0, before - longest):]
                    if any(s and s in tail for s in until):
                        break
        return postprocess_generated_text(self.tok.decode(new), until, None)

    # ---- chat ------------------------------------------------------------------------------------
    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by `laplace.chat_format`, special tokens as their strings. Ends with
        "<|assistant_start|>" after a user turn when add_generation_prompt; a final assistant
        message is closed by "<|assistant_end|>" when add_generation_prompt, else left open."""
        messages = [{"role": m["role"], "content": m["content"]} for m in chat_history]
        conversation = {"messages": messages}
        last = messages[-1]["role"] if messages else None
        if last == "user" and add_generation_prompt:
            ids = render_for_completion(self.tok, conversation)
        else:
            ids, _ = render_conversation(self.tok, conversation, max_tokens=None)
            if last == "assistant" and not add_generation_prompt:
                ids = ids[:-1]  # drop <|assistant_end|>: lm-eval continues this message
        return self.tok.decode(ids)


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line (`lm_eval.__main__.cli_evaluate`) with "laplace" registered;
    `argv` replaces sys.argv[1:] when given."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
