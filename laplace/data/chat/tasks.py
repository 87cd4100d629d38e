"""nanochat's chat tasks: rows of a dataset split -> conversations in laplace.chat_format's format,
built on access (docs/text_data.md lists each task's source and fields)."""
import re
from collections.abc import Mapping, Sequence

from torch.utils.data import Dataset


def render_mc(question: str, letters: Sequence[str], choices: Sequence[str]) -> str:
    """nanochat's multiple-choice prompt, verbatim: the letter after each choice binds better in
    small models, and "=A" (no space) gives the same token as the bare-letter answer."""
    query = f"Multiple Choice question: {question}\n"
    query += "".join(f"- {choice}={letter}\n" for letter, choice in zip(letters, choices))
    return query + "\nRespond only with the letter of the correct answer."


class ChatTask(Dataset):
    """Conversations over the rows of a `datasets.Dataset` (or any indexable of rows), built on
    access: a 460k-row task costs no memory up front (no `.map` into a second Arrow copy)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        # int(): i may be a numpy index; out of range, the rows (list or datasets.Dataset) raise IndexError
        return self.conversation(self.rows[int(i)])

    def conversation(self, row: Mapping) -> dict:
        raise NotImplementedError


class SmolTalk(ChatTask):
    """HuggingFaceTB/smol-smoltalk: `messages` [{role, content}] with an optional system
    message, passed through as they are (`render_conversation` checks the roles)."""

    def conversation(self, row):
        # Only role and content: render_conversation checks the roles and merges a system message.
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]]}


class MMLU(ChatTask):
    """cais/mmlu as lettered multiple choice. In `auxiliary_train` each row's fields are under
    a `train` column; nanochat unwraps it with a `.map`, here it is unwrapped on access (no
    rewritten Arrow copy of the 100k rows)."""

    letters = ("A", "B", "C", "D")

    def conversation(self, row):
        if "train" in row and isinstance(row["train"], Mapping):  # auxiliary_train's nesting
            row = row["train"]
        letters = self.letters[:len(row["choices"])]  # MMLU has four choices; fewer take fewer letters
        return {"messages": [{"role": "user", "content": render_mc(row["question"], letters, row["choices"])},
                             {"role": "assistant", "content": letters[int(row["answer"])]}],
                "subject": row.get("subject", ""), "letters": letters}


class ARC(ChatTask):
    """allenai/ai2_arc as lettered multiple choice with the dataset's own labels (a few rows
    use 1-4 instead of A-D), as nanochat."""

    def conversation(self, row):
        letters = tuple(row["choices"]["label"])  # the dataset's own: A-D, or 1-4 in a few rows
        return {"messages": [{"role": "user", "content": render_mc(row["question"], letters,
                                                                    row["choices"]["text"])},
                             {"role": "assistant", "content": row["answerKey"]}],
                "letters": letters}


_CALC = re.compile(r"(<<[^>]+>>)")


def gsm8k_parts(answer: str) -> list[dict]:
    """GSM8K's worked answer as assistant parts, as nanochat: each `<<expr=result>>` becomes a
    python part `expr` (the model's calculator call) and a python_output part `result` (the
    tool's answer); the text between them stays text, the final `#### N` included."""
    parts = []
    for piece in _CALC.split(answer):  # the split keeps the <<...>> pieces (a capturing group)
        if piece.startswith("<<") and piece.endswith(">>"):
            expr, eq, result = piece[2:-2].rpartition("=")
            if not eq:  # no "=": a call without a recorded result
                expr, result = piece[2:-2], ""
            parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


class GSM8K(ChatTask):
    """openai/gsm8k (subset main): question -> worked answer with calculator tool calls."""

    def conversation(self, row):
        return {"messages": [{"role": "user", "content": row["question"]},
                             {"role": "assistant", "content": gsm8k_parts(row["answer"])}]}
