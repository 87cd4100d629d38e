"""`task: pydoc_chat`: a built-in chat set about Python's help topics (no download)."""
import re

import numpy as np

from laplace.errors import ConfigError

from .tasks import MMLU, ChatTask, render_mc

# Three phrasings of one request per topic: the model learns the answer, not one template.
_QUESTIONS = ("What does the Python documentation say about {t}?",
              "Explain {t} in Python.",
              "I'm reading Python's reference manual. Can you summarise the section \"{t}\"?")


def _topic_title(text: str) -> str:
    return text.split("\n", 1)[0].strip()


def _subject(title: str) -> str:
    """A title as the object of a question: 'The "for" statement' -> 'the "for" statement'."""
    return "t" + title[1:] if title.startswith("The ") else title


def _blocks(text: str) -> list[tuple[bool, str]]:
    """A help topic after its title as (is_prose, text) blocks: prose paragraphs unwrapped onto
    one line, code and grammar blocks (indented in the source) kept verbatim, rules dropped."""
    body = text.split("\n", 1)[1] if "\n" in text else ""
    out = []
    for block in re.split(r"\n\s*\n", body):
        if not block.strip() or set(block.strip()) <= set("*=-"):  # empty, or a rule under a heading
            continue
        lines = block.split("\n")
        if lines[0].startswith((" ", "\t")):  # indented in the source: code or grammar
            out.append((False, block.rstrip()))
        else:
            out.append((True, " ".join(line.strip() for line in lines)))
    return out


def _capped(blocks: list[tuple[bool, str]], max_chars: int) -> str:
    """Whole blocks from the first prose paragraph on, up to max_chars; a first paragraph
    longer than that ends at its last full sentence within the cap."""
    while blocks and not blocks[0][0]:  # an answer opens with prose, not with a grammar block
        blocks = blocks[1:]
    out = ""
    for _, b in blocks:
        if out and len(out) + 2 + len(b) > max_chars:
            break
        out = f"{out}\n\n{b}" if out else b
    if len(out) > max_chars:  # one long first paragraph: end at a sentence, not mid-word
        cut = out[:max_chars]
        end = cut.rfind(". ")
        out = cut[:end + 1] if end > 0 else cut.rstrip() + "..."
    return out.rstrip(":") + ("." if out.endswith(":") else "")  # "... as follows:" without what follows


class PydocChat(ChatTask):
    """A built-in chat set from Python's help topics (no download, deterministic).

    For every topic of the split (every 10th topic sorted by name is held out, as
    `data=pydoc_text`): one question per template in `_QUESTIONS` about the topic's title,
    answered with its first paragraphs and code blocks (at most `max_chars`), and one
    multiple-choice question per stand-alone prose paragraph ("which section is this passage
    from?", four titles in nanochat's `render_mc` format, distractors drawn with a seed derived
    from the topic and paragraph). About 1,100 conversations in train and 60 in val (the
    topics vary with the Python version).

    Args:
        split: train | val.
        max_chars: longest answer in characters.
    """

    def __init__(self, split: str = "train", max_chars: int = 600):
        from pydoc_data.topics import topics

        from ..text import pydoc_documents

        if split not in ("train", "val"):
            raise ConfigError(f"pydoc_chat split={split!r}: choose train or val")
        docs = pydoc_documents(train=split == "train")
        all_titles = sorted({_topic_title(t) for t in topics.values()})  # distractors from both splits
        rows = []
        for d, text in enumerate(docs):
            title, blocks = _topic_title(text), _blocks(text)
            if not any(prose for prose, _ in blocks):
                continue
            answer = _capped(blocks, max_chars)
            rows += [{"kind": "qa", "title": title, "question": q.format(t=_subject(title)), "answer": answer}
                     for q in _QUESTIONS]
            # Passages for the multiple choice: prose that stands alone (not "... as follows:").
            passages = [b for prose, b in blocks if prose and len(b) >= 40 and not b.endswith(":")]
            others = [t for t in all_titles if t != title]
            for j, para in enumerate(passages):
                # Seeded by topic and paragraph: the same question whatever else the split holds.
                rng = np.random.default_rng([d, j, len(docs)])
                choices = [title] + [others[k] for k in rng.choice(len(others), 3, replace=False)]
                order = rng.permutation(4)
                rows.append({"kind": "mc", "passage": _capped([(True, para)], max_chars),
                             "choices": [choices[k] for k in order],
                             "answer": int(np.flatnonzero(order == 0)[0])})
        super().__init__(rows)

    def conversation(self, row):
        if row["kind"] == "qa":
            return {"messages": [{"role": "user", "content": row["question"]},
                                 {"role": "assistant", "content": row["answer"]}]}
        letters = MMLU.letters
        question = f"Which section of the Python documentation is this passage from?\n\n{row['passage']}\n"
        return {"messages": [{"role": "user", "content": render_mc(question, letters, row["choices"])},
                             {"role": "assistant", "content": letters[row["answer"]]}],
                "letters": letters}
