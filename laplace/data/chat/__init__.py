"""Chat data for mid-training and SFT: where tasks come from (sources), nanochat's tasks and the
built-in pydoc_chat, their mixture, and the two datasets the trainer consumes. The manual (tasks,
folder layouts, mixture semantics): docs/text_data.md."""
from .datasets import PackedChatDataset, SFTDataset, sft_collate
from .mixture import DEFAULT_SUBSETS, TASKS, ChatMixture, build_mixture, load_task
from .pydoc_chat import PydocChat
from .sources import HUB_IDS, load_split
from .tasks import ARC, GSM8K, MMLU, ChatTask, SmolTalk, gsm8k_parts, render_mc

__all__ = ["ARC", "DEFAULT_SUBSETS", "GSM8K", "HUB_IDS", "MMLU", "TASKS", "ChatMixture", "ChatTask",
           "PackedChatDataset", "PydocChat", "SFTDataset", "SmolTalk", "build_mixture", "gsm8k_parts",
           "load_split", "load_task", "render_mc", "sft_collate"]
