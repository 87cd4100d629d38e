"""Conversations -> token ids and a training mask: nanochat's chat format.

A conversation is plain data, the format nanochat's tasks produce:

    {"messages": [{"role": "system", "content": "Be brief."},          # optional, first only
                  {"role": "user", "content": "What is 2 + 3?"},
                  {"role": "assistant", "content": [                   # a str, or a list of parts
                      {"type": "text", "text": "2 + 3 = "},
                      {"type": "python", "text": "2+3"},                # a calculator / tool call
                      {"type": "python_output", "text": "5"},           # what the tool answered
                      {"type": "text", "text": "5."}]}]}

`render_conversation` turns it into

    <|bos|> <|user_start|> user text <|user_end|> <|assistant_start|> reply <|assistant_end|> ...

with a mask that is 1 exactly on the tokens the model must learn to produce: the assistant's
content, its tool calls `<|python_start|> code <|python_end|>` and `<|assistant_end|>` (so it
learns when to stop); 0 on `<|bos|>`, the user turns, `<|assistant_start|>` and the tool's output
`<|output_start|> out <|output_end|>` (the tool writes those, not the model).

As nanochat (`RustBPETokenizer.render_conversation`): a system message is merged into the first
user message (`system + "\n\n" + user`), roles alternate user / assistant starting with the user,
the ids are truncated to `max_tokens`, and special tokens are inserted by id, never parsed out of
text, so a user typing "<|assistant_end|>" cannot forge a turn. Unlike nanochat, a malformed
conversation raises `ConversationError` (a one-line `ValueError` naming the conversation)
instead of an assert, and `render_conversations` renders many at once so that all their texts
go through one `encode_batch` call (the tokenizer's threads: mid-training renders ~10^6 of them).

The chat special tokens must exist in the tokenizer (`bytes` and trained `bpe` tokenizers have
them, GPT-2's does not: its `special_id` raises a one-line ConfigError, which propagates).
"""
from collections.abc import Iterable, Mapping, Sequence

from .errors import UserError
from .tokenizer import SPECIAL_TOKENS

PART_TYPES = ("text", "python", "python_output")


class ConversationError(UserError, ValueError):
    """A conversation that breaks the chat format (roles, parts); the message is one line and
    names the conversation by the start of its first message."""


def special_ids(tok) -> dict[str, int]:
    """{name: id} of `<|bos|>` and the chat tokens; a tokenizer without them raises its own
    one-line ConfigError (e.g. gpt2)."""
    return {name: tok.special_id(name) for name in SPECIAL_TOKENS}  # "<|bos|>": bos_id, whatever its name


def _describe(conversation) -> str:
    """Name a conversation in an error message: the start of its first message's text."""
    try:
        first = conversation["messages"][0]["content"]
    except (KeyError, IndexError, TypeError):
        return f"conversation {str(conversation)[:60]!r}"
    first = " ".join(str(first).split())  # a list of parts too, on one line
    return f"conversation starting {first[:50]!r}"


def _messages(conversation) -> list[dict]:
    """The validated messages, the system message merged into the first user message."""
    def bad(why: str) -> ConversationError:
        return ConversationError(f"{_describe(conversation)}: {why}")

    messages = conversation.get("messages") if isinstance(conversation, Mapping) else None
    if not isinstance(messages, Sequence):
        raise bad("expected {'messages': [...]}")
    if not messages:
        raise bad("it has no messages")
    if not all(isinstance(m, Mapping) for m in messages):
        raise bad("every message must be a {'role': ..., 'content': ...} mapping")
    messages = list(messages)
    if messages[0].get("role") == "system":  # nanochat's surgery: prepend it to the first user turn
        if len(messages) < 2 or messages[1].get("role") != "user":
            raise bad("a system message must be followed by a user message")
        if not isinstance(messages[0].get("content"), str):
            raise bad("the system message's content must be a string")
        merged = {**messages[1], "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
        messages = [merged] + messages[2:]
    for i, m in enumerate(messages):
        # roles alternate user, assistant, ... starting with the user (as nanochat asserts)
        want, role, content = ("user", "assistant")[i % 2], m.get("role"), m.get("content")
        if role != want:
            raise bad(f"message {i} (after merging the system message) is from {role!r} but should be from "
                      f"{want!r}: roles alternate user, assistant, ... starting with the user")
        if role == "user" and not isinstance(content, str):
            raise bad(f"user message {i} must have string content, got {type(content).__name__}")
        if role == "assistant" and not isinstance(content, (str, list, tuple)):
            raise bad(f"assistant message {i} must have a string or a list of parts, got {type(content).__name__}")
    return messages


def _segments(conversation) -> list[tuple[str | None, str | None, int]]:
    """The conversation as (special token name or None, text or None, mask) segments, before
    tokenization, so that many conversations' texts can be encoded in one batch."""
    # mask 1 exactly on what the model must learn to produce; the document start is given
    segs: list[tuple[str | None, str | None, int]] = [("<|bos|>", None, 0)]
    for m in _messages(conversation):
        content = m["content"]
        if m["role"] == "user":  # the user's turn is conditioned on, never learnt
            segs += [("<|user_start|>", None, 0), (None, content, 0), ("<|user_end|>", None, 0)]
            continue
        segs.append(("<|assistant_start|>", None, 0))  # the prompt gives it; the reply follows
        if isinstance(content, str):
            segs.append((None, content, 1))
        else:
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                text = part.get("text") if isinstance(part, Mapping) else None
                if kind not in PART_TYPES or not isinstance(text, str):
                    raise ConversationError(f"{_describe(conversation)}: assistant part {part!r:.80} "
                                            f"must be {{'type': one of {PART_TYPES}, 'text': str}}")
                if kind == "text":
                    segs.append((None, text, 1))
                elif kind == "python":  # the model writes the tool call: learnt
                    segs += [("<|python_start|>", None, 1), (None, text, 1), ("<|python_end|>", None, 1)]
                else:  # the tool writes its output: conditioned on, never learnt
                    segs += [("<|output_start|>", None, 0), (None, text, 0), ("<|output_end|>", None, 0)]
        segs.append(("<|assistant_end|>", None, 1))  # learnt: the model must learn when to stop
    return segs


def render_conversations(tok, conversations: Iterable, max_tokens: int | None = 2048,
                         num_threads: int | None = None) -> list[tuple[list[int], list[int]]]:
    """`render_conversation` of many conversations, their texts tokenized in one
    `tok.encode_batch` call. Returns [(ids, mask), ...] in order."""
    specials = special_ids(tok)  # a tokenizer without chat tokens fails here, in its one line
    # Every text of every conversation in one encode_batch: mid-training renders ~10^6 of them,
    # and tiktoken's threads only pay off on large batches.
    all_segs = [_segments(c) for c in conversations]
    texts = [text for segs in all_segs for name, text, _ in segs if name is None and text]
    encoded = iter(tok.encode_batch(texts, num_threads=num_threads) if texts else [])
    out = []
    for segs in all_segs:
        ids: list[int] = []
        mask: list[int] = []
        for name, text, m in segs:
            if name is not None:  # inserted by id, never parsed out of text: a turn cannot be forged
                piece = [specials[name]]
            elif text:
                piece = next(encoded)
            else:  # an empty text part tokenizes to nothing
                continue
            ids += piece
            mask += [m] * len(piece)
        if max_tokens is not None:  # nanochat truncates long conversations (bounds the batch)
            ids, mask = ids[:max_tokens], mask[:max_tokens]
        out.append((ids, mask))
    return out


def render_conversation(tok, conversation, max_tokens: int | None = 2048) -> tuple[list[int], list[int]]:
    """(ids, mask) of one conversation: mask 1 on the tokens the model is trained to produce
    (assistant content, tool calls, `<|assistant_end|>`), 0 elsewhere; both truncated to
    `max_tokens` (None: no limit). See the module docstring for the format."""
    return render_conversations(tok, [conversation], max_tokens)[0]


def chat_prompt_text(user: str) -> str:
    """A one-turn prompt as text with the special tokens' strings, what `render_for_completion`
    gives for a conversation of this user turn (the lm-eval tasks' prompts; the `laplace` model
    adapter maps the strings back to the ids)."""
    return f"<|bos|><|user_start|>{user}<|user_end|><|assistant_start|>"


def render_for_completion(tok, conversation) -> list[int]:
    """The prompt that makes the model answer the conversation's last user turn: a trailing
    assistant message (the reference answer of a task) is dropped and `<|assistant_start|>`
    appended. Never truncated: cutting the prompt's end would cut the question."""
    messages = list(conversation.get("messages", ())) if isinstance(conversation, Mapping) else []
    if messages and messages[-1].get("role") == "assistant":  # a task's reference answer
        messages = messages[:-1]
    if not messages or messages[-1].get("role") != "user":
        raise ConversationError(f"{_describe(conversation)}: a completion needs a conversation that "
                                f"ends with a user message")
    ids, _ = render_conversation(tok, {**conversation, "messages": messages}, max_tokens=None)
    return ids + [tok.special_id("<|assistant_start|>")]
