"""Built-in lm-eval tasks on Python's help text: what `python -m eval.lm` measures with no data
to download (the offline counterpart of laplace_chat, for the quick start and tests).

    laplace_pydoc_mc    the held-out topics' "which section of the Python documentation is this
                        passage from?" questions (laplace.data.chat.PydocChat, val split: four
                        titles in nanochat's render_mc format), in the chat format, scored on the
                        answer letter right after <|assistant_start|> as laplace_chat's ARC; acc
    laplace_pydoc_text  the held-out help topics (laplace.data.text.pydoc_documents, the
                        validation split of data=pydoc_text / pydoc_bpe) as documents for
                        loglikelihood_rolling: word perplexity, byte perplexity, bits per byte
"""
from laplace.chat_format import chat_prompt_text


def load_mc(**_metadata):
    import datasets

    from laplace.data.chat import MMLU, PydocChat, render_mc

    # the val split: every 10th help topic, held out of pre-training (pydoc_text) and SFT alike
    rows = [r for r in PydocChat("val").rows if r["kind"] == "mc"]
    question = "Which section of the Python documentation is this passage from?\n\n{}\n"
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([
        {"prompt": chat_prompt_text(render_mc(question.format(r["passage"]), MMLU.letters, r["choices"])),
         "choices": list(MMLU.letters[:len(r["choices"])]), "answer": int(r["answer"])} for r in rows])})


def load_text(**_metadata):
    import datasets

    from laplace.data.text import pydoc_documents

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(
        [{"text": t} for t in pydoc_documents(train=False)])})
