"""Token-by-token sampling from a GPT: the streaming loop behind `python -m eval.generate`, and the
few greedy samples the trainer logs at each evaluation.

`stream_tokens` is `GPT.generate` (batch 1) as a Python generator: each step picks the token exactly
as `GPT.generate` does (argmax at temperature 0; else logits / temperature, the top-k filter, then
`torch.multinomial` with the caller's generator, which must live on the model's device), so with
the same seed both return the same ids.
"""
import ast
import operator
from collections.abc import Iterator, Sequence

import torch
from timm.utils import unwrap_model as unwrap  # the plain module under DDP and torch.compile
from torch import nn

from .errors import ConfigError


def check_sampling(temperature: float, top_k: int | None) -> None:
    """The one check of the sampling arguments (`GPT.generate`'s and `stream_tokens`')."""
    if temperature is None or temperature < 0:
        raise ConfigError(f"temperature={temperature}: use 0 (greedy) or a positive value")
    if top_k is not None and top_k < 0:
        raise ConfigError(f"top_k={top_k}: use a positive count, or 0 / null for no top-k")


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next ids [B, 1] from last-position logits [B, V], exactly as `GPT.generate` picks them."""
    if temperature == 0:  # greedy: no draw, so the generator is left as it is
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:  # None or 0: the whole vocabulary
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


class Calculator:
    """nanochat's tool use at sampling time: when the model closes `<|python_start|> expr
    <|python_end|>`, the value of `expr` is forced into the stream as `<|output_start|> value
    <|output_end|>` (the tokens SFT taught it to expect from GSM8K's calculator annotations),
    and generation continues after it. `expr` is evaluated by `calculate`: arithmetic only."""

    def __init__(self, tok):
        self.tok = tok
        self.start, self.end = tok.special_id("<|python_start|>"), tok.special_id("<|python_end|>")
        self.out_start, self.out_end = tok.special_id("<|output_start|>"), tok.special_id("<|output_end|>")

    def output_tokens(self, code_ids: Sequence[int]) -> list[int]:
        value = calculate(self.tok.decode(code_ids))
        return [] if value is None else [self.out_start, *self.tok.encode(str(value)), self.out_end]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expr: str) -> int | float | None:
    """The value of an arithmetic expression (numbers, + - * / // %, parentheses, unary minus;
    commas in numbers are dropped), or None for anything else. nanochat evaluates such strings
    with a restricted `eval` and a timeout; walking the syntax tree needs neither: nothing but
    arithmetic can run, and powers (the one slow operation) are refused."""
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("not arithmetic")

    try:
        value = ev(ast.parse(expr.replace(",", "").strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, TypeError):
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)  # 12 / 4 -> 3, as a person writes it
    return round(value, 6) if isinstance(value, float) else value


# inference_mode as a decorator: applied per step, while a `with` block inside a generator would
# stay active in the caller between steps
@torch.inference_mode()
def _stream(model, prompt_ids, max_new_tokens, temperature, top_k, stop_ids, generator, tools):
    device = model.wte.weight.device
    # The prompt fills the KV cache in one forward; then each step feeds only the new token,
    # so a reply of n tokens costs n one-token forwards (as GPT.generate, with batch 1).
    cache = model.new_kv_cache(1, len(prompt_ids) + max_new_tokens)
    logits = model(torch.tensor([list(prompt_ids)], dtype=torch.long, device=device), kv_cache=cache)[:, -1, :]
    forced: list[int] = []  # tool output to feed before sampling again
    code: list[int] | None = None  # ids since <|python_start|>, while the model writes code
    for i in range(max_new_tokens):
        # one host sync per token: the caller wants it now anyway
        token = forced.pop(0) if forced else int(sample_next(logits, temperature, top_k, generator))
        if token in stop_ids:  # e.g. a chat reply's <|assistant_end|>: GPT.generate runs on, we stop
            return
        yield token
        if tools is not None:
            if token == tools.start:
                code = []
            elif token == tools.end and code is not None:
                forced.extend(tools.output_tokens(code))
                code = None
            elif code is not None:
                code.append(token)
        if i + 1 < max_new_tokens:  # no forward for a token nobody will read
            logits = model(torch.tensor([[token]], dtype=torch.long, device=device), kv_cache=cache)[:, -1, :]


def stream_tokens(model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                  temperature: float = 0.0, top_k: int | None = None, stop_ids: Sequence[int] = (),
                  generator: torch.Generator | None = None, tools: Calculator | None = None) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids after `prompt_ids`, one at a time.

    Args:
        model: a GPT (DDP / torch.compile wrappers are looked through: one-token steps would
            recompile a compiled model at every new length).
        prompt_ids: the prompt (with its <|bos|>), encoded once into the KV cache.
        temperature: 0 is greedy; else the softmax temperature.
        top_k: sample among the k most likely tokens (None or 0: all).
        stop_ids: stop when one of these is sampled; it is not yielded.
        generator: the sampling RNG, on the model's device (None: torch's global one).
        tools: a `Calculator`: its outputs are forced into the stream (and yielded; they count
            towards max_new_tokens); None: every token is sampled.

    Arguments are checked when this is called, not at the first step.
    """
    model = unwrap(model)  # a compiled model would recompile at every new length
    check_sampling(temperature, top_k)
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: use a count >= 0")
    if len(prompt_ids) == 0:
        raise ConfigError("the prompt is empty: give at least one token (e.g. <|bos|>)")
    top = max(int(i) for i in prompt_ids)
    if top >= model.vocab_size or min(int(i) for i in prompt_ids) < 0:
        raise ConfigError(f"prompt token id {top} is outside the model's vocabulary "
                          f"(vocab_size={model.vocab_size}): the tokenizer does not match the model")
    if len(prompt_ids) + max_new_tokens > model.rope_len:
        raise ConfigError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens={max_new_tokens} exceeds "
                          f"the model's longest sequence ({model.rope_len}); lower max_new_tokens")
    return _stream(model, prompt_ids, max_new_tokens, temperature, top_k,
                   frozenset(int(i) for i in stop_ids), generator, tools)


def sample_texts(model: nn.Module, tok, prompts: Sequence[str], max_new_tokens: int = 32) -> list[str]:
    """Greedy completions of `prompts` (each after <|bos|>), decoded: what the trainer logs at
    each evaluation to show what the model has learnt. A completion ends early at a <|bos|>
    (the model starting a new document). Runs on the model's device; the model's train / eval
    mode is left as it is (a GPT has no dropout, so it does not matter)."""
    outs = []
    for prompt in prompts:
        ids = list(stream_tokens(model, tok.encode(prompt, prepend_bos=True), max_new_tokens,
                                 stop_ids=(tok.bos_id,)))
        outs.append(tok.decode(ids))
    return outs
