"""The RAG demo's corpus: real text that ships with Python, the documentation of standard-library
modules as `pydoc` renders it, each cut to a few hundred tokens at a line boundary; the
questions asked over it (each answered by one document, asked over two to four of them); and
the prompts, as ChatML token ids or as PromptParts."""

from __future__ import annotations

import importlib
import pydoc
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.engine import PromptPart
    from tierkv.engine.tokenizer import Tokenizer

MODULES = ("zlib", "colorsys", "textwrap", "uuid", "secrets", "calendar")
SYSTEM = (
    "You answer questions about Python's standard library from the documentation below. "
    "Answer in one short sentence, using only facts from the documentation."
)


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    docs: tuple[int, ...]  # indices into MODULES, in prompt order
    expect: str  # a word the right answer holds (case-insensitive)


# Process A asks QUESTION_A over every document in MODULES order; process B asks QUESTIONS, each
# over other documents in other orders: only Q1 starts the way A's prompt does (its prefix hits
# the server) and Q5 the way Q3 does (its prefix hits what B itself stored).
QUESTION_A = Question("What does zlib.adler32 compute?", (0, 1, 2, 3, 4, 5), "adler-32")
QUESTIONS = (
    Question("What does zlib.crc32 compute?", (0, 1, 4), "crc-32"),
    Question("What is the default width of textwrap.TextWrapper?", (3, 2), "70"),
    Question("Which RFC do the uuid objects follow?", (5, 3, 1, 4), "4122"),
    Question("What does the secrets module generate?", (4, 3, 0), "cryptographically strong"),
    Question(
        "Which day does the calendar module use as the first day of the week?", (5, 0), "monday"
    ),
)


def module_doc(name: str) -> str:
    """pydoc's plain-text page for a module, without its bold (char + backspace + char) and
    without the MODULE REFERENCE paragraph every page repeats."""
    module = importlib.import_module(name)
    text = pydoc.render_doc(module, renderer=pydoc.plaintext)  # type: ignore[attr-defined]
    text = re.sub(".\b", "", text)
    return re.sub(r"MODULE REFERENCE\n.*?\n\n(?=[A-Z])", "", text, flags=re.S)


def cut(text: str, count: Callable[[str], int], max_tokens: int) -> str:
    """The longest run of text's leading lines that holds at most max_tokens tokens."""
    lines, kept = text.splitlines(), 0
    while kept < len(lines) and count("\n".join(lines[: kept + 1])) <= max_tokens:
        kept += 1
    return "\n".join(lines[:kept]).rstrip()


def documents(count: Callable[[str], int], max_tokens: int) -> list[str]:
    return [cut(module_doc(m), count, max_tokens) for m in MODULES]


class Corpus:
    """Token ids of the system prefix, of each document (its text and a blank line) and of each
    question's tail, tokenized apart, so that every way of asking sees the same ids."""

    def __init__(self, tok: Tokenizer, max_tokens: int = 260) -> None:
        self.tok = tok
        self.system = self.enc(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
        self.docs = [
            self.enc(d + "\n\n") for d in documents(lambda s: len(self.enc(s)), max_tokens)
        ]

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def tail(self, q: Question) -> list[int]:
        return self.enc(f"Question: {q.text}<|im_end|>\n<|im_start|>assistant\n")

    def flat(self, q: Question) -> list[int]:
        """The prompt as plain token ids: only an exact prefix of it can be reused."""
        return self.system + sum((self.docs[i] for i in q.docs), []) + self.tail(q)

    def parts(self, q: Question) -> list[PromptPart]:
        """The same ids in parts: the system prompt as the shared prefix, each document a
        reusable segment, the question computed every time."""
        from tierkv.engine import PromptPart

        return (
            [PromptPart(self.system, prefix=True)]
            + [PromptPart(self.docs[i]) for i in q.docs]
            + [PromptPart(self.tail(q), reusable=False)]
        )
