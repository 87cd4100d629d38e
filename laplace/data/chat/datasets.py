"""What the trainer consumes of conversations: padded SFT rows (`SFTDataset` + `sft_collate`,
nanochat's chat_sft) and packed mid-training rows (`PackedChatDataset`)."""
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from laplace.chat_format import render_conversation, render_conversations, special_ids
from laplace.errors import ConfigError

from ..text import TokenWindows


class SFTDataset(Dataset):
    """One rendered conversation per item: (ids LongTensor[L], mask LongTensor[L]), L <=
    max_tokens. Rendering happens on access (in the DataLoader's workers); batch with
    `sft_collate`.

    Args:
        conversations: any indexable of conversations (a task, a ChatMixture, a list).
        tok: the tokenizer (with the chat special tokens).
        max_tokens: truncate longer conversations (nanochat: 2048).
    """

    def __init__(self, conversations, tok, max_tokens: int = 2048):
        special_ids(tok)  # fail here, not in a worker, when the tokenizer has no chat tokens
        # Rendered on access, in the workers: a 460 k-conversation mixture costs no memory up front.
        self.conversations, self.tok, self.max_tokens = conversations, tok, max_tokens

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = render_conversation(self.tok, self.conversations[i], self.max_tokens)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


def sft_collate(items: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch SFT items as nanochat's chat_sft: x [B, T] the ids without their last token,
    y [B, T] the ids without their first, set to -1 (ignore_index) where the target's mask is 0
    and on padding; T = the longest item's length - 1. nanochat pads x with <|assistant_end|>:
    any id works since padded targets are ignored and attention is causal."""
    T = max(len(ids) for ids, _ in items) - 1  # padded to the batch's longest, not to max_tokens
    if T < 1:
        raise ValueError("sft_collate: every conversation has fewer than 2 tokens")
    # Any pad id works (nanochat's is <|assistant_end|>): padded targets are ignored and attention is
    # causal, so no real token ever attends to a pad.
    x = torch.full((len(items), T), pad_id, dtype=torch.long)
    y = torch.full((len(items), T), -1, dtype=torch.long)
    for b, (ids, mask) in enumerate(items):
        n = len(ids) - 1
        if n < 1:
            continue
        x[b, :n] = ids[:-1]
        # The loss sees the assistant's tokens only: -1 (ignore_index) elsewhere.
        y[b, :n] = torch.where(mask[1:].bool(), ids[1:], torch.full_like(ids[1:], -1))
    return x, y


class PackedChatDataset(TokenWindows):
    """Mid-training rows: every conversation rendered (in order, untruncated), concatenated, and
    cut into TokenWindows. Item i is (x [seq_len], y [seq_len]) with y set to -1 where the target's
    mask is 0 (with `masked`; nanochat's mid-training trains on every token: masked=False).

    Args:
        conversations: any indexable of conversations.
        tok: the tokenizer (with the chat special tokens).
        seq_len: the model's context.
        masked: ignore targets whose mask is 0 (user turns, tool outputs, <|bos|>).
        chunk: conversations rendered per `encode_batch` call (bounds the Python lists).
    """

    def __init__(self, conversations, tok, seq_len: int, masked: bool = True, chunk: int = 4096):
        n = len(conversations)
        tokens, masks = [np.zeros(0, np.int32)], [np.zeros(0, np.bool_)]
        # Rendered in chunks through the tokenizer's threaded batch encode, kept as int32 + bool
        # (5 bytes a token): as Python lists of ints a large mixture would take tens of bytes a token.
        for start in range(0, n, chunk):
            batch = [conversations[i] for i in range(start, min(n, start + chunk))]
            for ids, mask in render_conversations(tok, batch, max_tokens=None):
                tokens.append(np.asarray(ids, dtype=np.int32))
                masks.append(np.asarray(mask, dtype=np.bool_))
        super().__init__(torch.from_numpy(np.concatenate(tokens)), seq_len)
        self.mask, self.masked = torch.from_numpy(np.concatenate(masks)), masked
        if self.n == 0:
            raise ConfigError(f"seq_len={seq_len} is longer than all {n} conversations together "
                              f"({len(self.tokens)} tokens): use more conversations or a shorter seq_len")

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw window i: (tokens LongTensor[seq_len + 1], mask BoolTensor[seq_len + 1])."""
        s = self.window(i)
        return self.tokens[s].long(), self.mask[s]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask = self.row(i)
        x, y = tokens[:-1], tokens[1:].clone()  # clone: y is written to, tokens is the shared stream
        if self.masked:
            y[~mask[1:]] = -1
        return x, y
