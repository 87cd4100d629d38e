"""lm-evaluation-harness (lm-eval 0.4.13) for our GPTs: the model "laplace".

lm-eval finds out-of-tree models only through `register_model` run in its own process, so
importing this module registers `LaplaceLM`, and `python -m eval.lm_adapter` is lm-eval's own
command line with the model registered. `python -m eval.lm` drives it for the paper's protocol.
The manual (arguments, how each request type is scored, several GPUs): docs/lm_adapter.md.
"""
import atexit
import sys

if __name__ == "__main__":
    # `python -m eval.lm_adapter` runs this file as __main__: make `import eval.lm_adapter` return
    # this module, so the "laplace" model is registered once, by one class.
    sys.modules.setdefault("eval.lm_adapter", sys.modules[__name__])

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from train import dist
from laplace.chat_format import render_conversation, render_for_completion
from laplace.errors import ConfigError
from laplace.sampling import Calculator, stream_tokens

from .generate import load_gpt

@register_model("laplace")
class LaplaceLM(LM):
    """A laplace GPT as an lm-eval model (docs/lm_adapter.md).

    Args:
        checkpoint: a GPT's laplace checkpoint or exported folder; model and tokenizer come from it.
        device: auto (CUDA when available) | cpu | cuda[:N]; under torchrun each rank's own GPU.
        dtype: auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16 | float16.
        batch_size: sequences per forward ("auto": 8, there is no batch-size search).
        max_length: the longest window (default: the training context).
        max_gen_toks: the generation limit of requests that name none.
        seed: the sampling generator's seed (do_sample requests only).
        tokenizer: a path (or bytes | gpt2) where the run's tokenizer file has moved.
    """

    def __init__(self, checkpoint: str, device: str = "auto", dtype: str = "auto", batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, seed: int = 1234,
                 tokenizer: str | None = None, max_batch_size: int | None = None):  # lm-eval's, for batch_size=auto
        super().__init__()
        # under torchrun one GPU per process, the local rank's (lm-eval's CLI defaults to cuda:0)
        device = "cuda" if dist.env_ranks()[1] > 1 and str(device).startswith("cuda") else str(device)
        info = dist.setup(device)  # one process: the device; under torchrun: the group too
        self._rank, self._world_size, self._device = info.rank, info.world_size, info.device
        if info.distributed:
            atexit.register(dist.cleanup)
        self.model, self.tok, self.info = load_gpt(checkpoint, self._device, tokenizer)

        dtype = str(dtype).lower()
        if dtype == "auto":
            dtype = "bfloat16" if self._device.type == "cuda" else "float32"
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype={dtype}: choose auto, float32, bfloat16 or float16")
        self._amp_dtype = getattr(torch, dtype)  # the weights stay fp32; bf16 / fp16 through autocast
        # the training context: a checkpoint's data.seq_len, which an export's model node also holds
        self.max_length = int(max_length or self.info["seq_len"] or self.info["node"].get("max_seq_len") or 2048)
        if self.max_length > self.model.rope_len:
            raise ConfigError(f"max_length={self.max_length} exceeds the model's rotary table "
                              f"({self.model.rope_len} positions)")
        self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)
        bs = str(batch_size)
        self.batch_size = 8 if bs.startswith("auto") else int(bs) if bs.isdigit() else 0
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r}: use a positive integer")
        # a generation also ends where the model ends its chat turn or starts a new document
        end = self.tok.special_tokens.get("<|assistant_end|>")
        self.stop_ids = frozenset(i for i in (self.tok.bos_id, end) if i is not None and i < self.model.vocab_size)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # lm-eval's CLI also passes its --batch_size and --device: those in --model_args win (the
        # base class would refuse the pair with a TypeError)
        return cls(**{**{k: v for k, v in (additional_config or {}).items() if v is not None}, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def tokenizer_name(self) -> str:
        # names the tokenizer in lm-eval's request-cache keys
        return f"laplace-{self.tok.kind}-{self.tok.fingerprint()[:16]}"

    def chat_template(self, chat_template: bool | str = False) -> str:
        # for lm-eval's logged config only: `apply_chat_template` renders, not a Jinja template
        return "laplace.chat_format (nanochat): <|bos|><|user_start|>...<|user_end|><|assistant_start|>..."

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(self._amp_dtype), "checkpoint": str(self.info["path"]),
                "checkpoint_git_rev": self.info["git_rev"] or "unknown", "max_length": self.max_length}

    # ---- data parallelism: lm-eval's evaluator calls these when world_size > 1 ----------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()  # lm-eval gathers counts (0-d)
        out = [torch.empty_like(t) for _ in range(self._world_size)]
        torch.distributed.all_gather(out, t)
        return torch.cat(out)

    def gather_object(self, obj, dst: int = 0):
        objs = dist.all_gather_object(obj)  # [obj] on one process
        return objs if self._rank == dst else None

    barrier = staticmethod(dist.barrier)

    # ---- tokens -------------------------------------------------------------------------------------
    def tok_encode(self, text: str) -> list[int]:
        """Ids of `text`, special-token strings as their ids, `<|bos|>` first."""
        # our models saw a bos before every document; a rendered chat prompt starts with it already
        ids = self.tok.encode_with_specials(text)
        return ids if ids[:1] == [self.tok.bos_id] else [self.tok.bos_id, *ids]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # lm-eval's HF split: trailing spaces move to the continuation, the whole is encoded once
        # and the continuation is what follows the context's ids
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
        cont = whole[len(ctx):]
        if not cont and continuation:
            # merged into the context's last token (HF's split would score nothing): split the
            # whole where the two encodings part
            n = next((i for i, (a, b) in enumerate(zip(ctx, whole)) if a != b), len(whole))
            n = max(1, min(n, len(whole) - 1))
            ctx, cont = whole[:n], whole[n:]
        return ctx, cont

    def _amp(self):
        return torch.autocast(self._device.type, dtype=self._amp_dtype, enabled=self._amp_dtype != torch.float32)

    # ---- loglikelihood ------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [(tuple(r.args), *self._encode_pair(*r.args)) for r in requests]
        return self._loglikelihood_tokens(pairs, disable_tqdm=disable_tqdm)

    @torch.inference_mode()
    def _loglikelihood_tokens(self, pairs: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, is_greedy) of each (strings or None, context ids,
        continuation ids), in order; one right-padded forward per batch. A request's strings key
        lm-eval's request cache; None (a rolling window) is not cached."""
        for strings, _, cont in pairs:
            if len(cont) > self.max_length:  # refused, never silently cut
                raise ConfigError(f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}: it "
                                  f"cannot be scored in one window (continuation starts {strings[1][:40]!r})")
        todo = [p for p in pairs if p[2]]  # an empty continuation is answered below: log P(nothing) = 0
        # lm-eval's Collator sorts longest first (the first batch fails first if memory is short) and
        # groups requests that differ only in their last token (letter answers): one row scores them all
        re_ord = Collator(todo, sort_fn=lambda p: (-len(p[1] + p[2]), tuple(p[1] + p[2])), group_by="contexts",
                          group_fn=lambda p: p[1] + p[2][:-1])
        res = []
        pbar = tqdm(total=len(todo), disable=disable_tqdm or self._rank != 0, desc="laplace: loglikelihood requests")
        for chunk in re_ord.get_batched(n=self.batch_size):
            inps = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]
            width = max(len(x) for x in inps)
            # right padding: it comes after every scored position, so causal attention never sees it
            batch = torch.tensor([x + [0] * (width - len(x)) for x in inps], dtype=torch.long, device=self._device)
            with self._amp():
                logits = self.model(batch)
            found = []  # (request strings, log-prob sum, is_greedy), the numbers as device scalars
            for (strings, ctx, cont), x, row in zip(chunk, inps, logits):
                span = row[len(x) - len(cont):len(x)].float().log_softmax(dim=-1)  # the positions predicting cont
                for strs, cont_i, lp in re_ord.get_cache(req_str=strings, cxt_toks=ctx, cont_toks=cont,
                                                         logits=span.unsqueeze(0)):
                    lp = lp[0, -len(cont_i):]  # a shorter continuation of the group: its last positions
                    target = torch.tensor(cont_i, dtype=torch.long, device=self._device)
                    found.append((strs, lp.gather(1, target[:, None]).sum(), (lp.argmax(dim=-1) == target).all()))
            sums = torch.stack([f[1] for f in found]).tolist()  # one host sync per batch, not per request
            greedy = torch.stack([f[2] for f in found]).tolist()
            for (strs, _, _), lp_sum, is_greedy in zip(found, sums, greedy):
                res.append((float(lp_sum), bool(is_greedy)))
                if strs is not None:
                    self.cache_hook.add_partial("loglikelihood", strs, res[-1])
            pbar.update(len(found))
        pbar.close()
        scored = iter(re_ord.get_original(res))
        return [next(scored) if p[2] else (0.0, True) for p in pairs]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        # lm-eval's disjoint windows of max_length tokens, <|bos|> the prefix token, summed per text
        windows, owner = [], []
        for k, r in enumerate(requests):
            ids = self.tok.encode_with_specials(r.args[0])
            ids = ids[1:] if ids[:1] == [self.tok.bos_id] else ids  # the prefix token is the bos
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=self.tok.bos_id, max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (lp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[k] += lp
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(r.args), total)
        return totals

    # ---- generation ---------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        gen = torch.Generator(device=self._device).manual_seed(self.seed)
        for r in tqdm(requests, disable=disable_tqdm or self._rank != 0, desc="laplace: generate_until requests"):
            out.append(self._generate(*r.args, gen))  # r.args: (context, gen_kwargs)
            self.cache_hook.add_partial("generate_until", r.args, out[-1])
        return out

    def _generate(self, context: str, gen_kwargs: dict, gen: torch.Generator) -> str:
        """One request with the KV cache (laplace.sampling.stream_tokens), greedy unless do_sample."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
        max_gen = int(kwargs.pop("max_gen_toks"))
        temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
        # generation_kwargs `tools: calculator` (laplace_chat_gsm8k): nanochat's calculator answers
        # the model's <|python_start|> ... <|python_end|> calls during generation
        tool = kwargs.pop("tools", None)
        if tool not in (None, "calculator"):
            raise ConfigError(f"generation_kwargs.tools={tool!r}: the only tool is calculator")
        # the prompt keeps its last tokens that leave room for max_gen in the rotary table (10x the
        # training context): unlike lm-eval's HF model, generated tokens may run past max_length
        # (at least one token: stream_tokens refuses a max_gen_toks that leaves no room, in one line)
        room = max(1, min(self.max_length, self.model.rope_len - max_gen))
        new = []
        with self._amp():
            for t in stream_tokens(self.model, self.tok_encode(context)[-room:], max_gen, temperature,
                                   kwargs.get("top_k") or None, self.stop_ids, gen,
                                   Calculator(self.tok) if tool else None):
                new.append(t)
                # stop once a stop string appears (in the decoded text: one may span tokens)
                if until and any(s and s in self.tok.decode(new) for s in until):
                    break
        return postprocess_generated_text(self.tok.decode(new), until, None)

    # ---- chat ---------------------------------------------------------------------------------------
    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by `laplace.chat_format`, special tokens as their strings: ends
        with "<|assistant_start|>" after a user turn when add_generation_prompt; a final assistant
        message is closed when add_generation_prompt, else left open (lm-eval's gen_prefix)."""
        conversation = {"messages": [{"role": m["role"], "content": m["content"]} for m in chat_history]}
        last = chat_history[-1]["role"] if chat_history else None
        if last == "user" and add_generation_prompt:
            return self.tok.decode(render_for_completion(self.tok, conversation))
        ids, _ = render_conversation(self.tok, conversation, max_tokens=None)
        if last == "assistant" and not add_generation_prompt:
            ids = ids[:-1]  # drop <|assistant_end|>: lm-eval continues this message
        return self.tok.decode(ids)


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()  # lm-eval's own command line, "laplace" registered above
