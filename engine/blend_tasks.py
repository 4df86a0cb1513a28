"""A task set for any-position reuse: fact questions over Python standard-library documentation
as `pydoc` renders it (real text that ships with Python, written by no one here).

Each question asks for a value that exactly one of its documents states: a module constant
(`MAX_WBITS = 15` in zlib's DATA section) or a function's default argument (`width=70` in
textwrap.fill's signature). The other documents are other modules' pages, chosen so that none
holds the answer or the name asked about. Every document is cut to a token budget that keeps
the line stating the fact. The answer is checked by a normalised whole-word match.
`python -m bench.blend --task` measures blend rules on it; `tierkv-engine calibrate-blend`
picks a model's rule from a sample of it.
"""

from __future__ import annotations

import importlib
import importlib.util
import pydoc
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from tierkv.engine.blend import PromptPart

# Modules whose pages state short constants or default arguments, few of them
# platform-dependent in a way that changes between runs on one machine.
MODULES = (
    "zlib textwrap heapq bisect pickle gzip bz2 lzma tarfile zipfile calendar colorsys difflib "
    "fnmatch shutil secrets base64 binascii csv fractions hashlib hmac imaplib ftplib poplib "
    "smtplib tempfile wave sched shlex struct reprlib statistics uuid json html quopri "
    "netrc plistlib configparser filecmp gettext locale pprint tokenize keyword codeop stat "
    "errno select mmap resource"
).split()
SYSTEM = (
    "You answer questions about Python's standard library from the documentation below. "
    "Answer with the value only."
)
VALUE = r"-?\d+(?:\.\d+)?|'[\w.-]{1,24}'"  # a number or a short quoted word


@dataclass(frozen=True, slots=True)
class Fact:
    module: str
    name: str  # what the page names: the constant, or the argument in its signature
    answer: str  # the value as the page states it (quotes dropped)
    question: str
    line: int  # the index of the page's line that states it
    lead: str  # the reply's first words, given: the next token is the answer's first


@dataclass(frozen=True, slots=True)
class Task:
    """One question over its documents (texts, in prompt order); docs[about] holds the answer."""

    question: str
    answer: str
    docs: tuple[str, ...]
    about: int
    source: str  # "pydoc" (this module's facts) or another set's name
    lead: str = ""  # the reply's first words, given after the assistant turn opens


def page(module: str) -> list[str]:
    """pydoc's plain-text page of a module, as lines, without its bold (char, backspace, char)
    and the MODULE REFERENCE paragraph every page repeats."""
    text = pydoc.render_doc(importlib.import_module(module), renderer=pydoc.plaintext)  # type: ignore[attr-defined]
    text = re.sub(".\b", "", text)
    text = re.sub(r"MODULE REFERENCE\n.*?\n\n(?=[A-Z])", "", text, flags=re.S)
    return text.splitlines()


def facts(module: str, lines: list[str]) -> list[Fact]:
    """The module's constants (DATA) and functions' default arguments (FUNCTIONS) whose value
    is a number or a short quoted word."""
    out, section = [], ""
    for i, line in enumerate(lines):
        if re.fullmatch(r"[A-Z][A-Z ]+", line):
            section = line
        elif section == "DATA" and (m := re.fullmatch(rf"    ([A-Za-z]\w*) = ({VALUE})", line)):
            q = f"What is the value of {m[1]} in the {module} module?"
            out.append(Fact(module, m[1], m[2].strip("'"), q, i, f"{m[1]} ="))
        elif section == "FUNCTIONS" and (m := re.fullmatch(r"    ([a-z]\w*)\((.*)\)", line)):
            for arg in m[2].split(", "):
                if d := re.fullmatch(rf"([a-z]\w*)=({VALUE})", arg):
                    q = f"What is the default value of the {d[1]} argument of {module}.{m[1]}?"
                    lead = f"The default value of {d[1]} is"
                    out.append(Fact(module, f"{d[1]}=", d[2].strip("'"), q, i, lead))
    return out


def normal(text: str) -> str:
    return " ".join(text.lower().replace("'", " ").replace('"', " ").replace("`", " ").split())


def holds(text: str, word: str) -> bool:
    """Whether text holds word as a whole word (normalised: case, quotes, spacing)."""
    w = re.escape(normal(word))
    return re.search(rf"(?<![\w.]){w}(?![\w]|\.\d)", normal(text)) is not None


def cut(lines: list[str], count: Callable[[str], int], budget: int) -> str:
    """The longest run of leading lines within budget tokens."""
    kept = 0
    while kept < len(lines) and count("\n".join(lines[: kept + 1])) <= budget:
        kept += 1
    return "\n".join(lines[:kept]).rstrip()


def around(lines: list[str], at: int, count: Callable[[str], int], budget: int) -> str:
    """The page's first lines (its name and summary) and, after an ellipsis, the section that
    states line `at` from a few lines before it, within budget tokens; line `at` is kept."""
    head = cut(lines[:8], count, budget // 3)
    start = max(at - 3, 0)
    sec = next((j for j in range(at, -1, -1) if re.fullmatch(r"[A-Z][A-Z ]+", lines[j])), at)
    body = ([lines[sec], "    ..."] if sec < start else []) + lines[max(start, sec) :]
    text = cut([head, "...", *body], count, budget)
    return text if lines[at] in text else cut([lines[at]], count, budget)


def tasks(
    count: Callable[[str], int],
    n: int,
    docs_per: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8),
    budget: int = 250,
    seed: int = 0,
) -> list[Task]:
    """n questions, each over docs_per[i % len] documents in a seeded shuffled order, documents
    cut to `budget` tokens (count(text) tokens), deterministic for a seed and a Python."""
    rng = random.Random(seed)
    mods = [m for m in MODULES if importlib.util.find_spec(m) is not None]  # this platform's
    pages = {m: page(m) for m in mods}
    tops = {m: cut(pages[m], count, budget) for m in mods}
    pool = [f for m in mods for f in facts(m, pages[m])]
    rng.shuffle(pool)
    out: list[Task] = []
    per: dict[str, int] = {}
    for f in pool:
        if len(out) == n:
            break
        if per.get(f.module, 0) >= max(2, n // 12):
            continue  # spread the questions over the modules
        doc = around(pages[f.module], f.line, count, budget)
        if not holds(doc, f.answer) or f.name not in doc:
            continue
        others = [
            m
            for m in mods
            if m != f.module and not holds(tops[m], f.answer) and f.name not in tops[m]
        ]
        k = docs_per[len(out) % len(docs_per)]
        if len(others) < k - 1:
            continue
        docs = [doc] + [tops[m] for m in rng.sample(others, k - 1)]
        order = rng.sample(range(k), k)
        per[f.module] = per.get(f.module, 0) + 1
        shuffled = tuple(docs[i] for i in order)
        out.append(Task(f.question, f.answer, shuffled, order.index(0), "pydoc", f.lead))
    if len(out) < n:
        raise ValueError(f"the pydoc pages give {len(out)} questions, fewer than {n}")
    return out


def correct(answer_text: str, task: Task) -> bool:
    """Whether a reply states the task's answer (a normalised whole-word match)."""
    return holds(answer_text, task.answer)


def answer(reply: str) -> str:
    """A reply's answer, for comparing two replies: its first non-empty line, normalised, without
    a trailing full stop (the value the lead asked for, not the words after it)."""
    first = next((line for line in reply.splitlines() if line.strip()), "")
    return normal(first).rstrip(".")


def prompt(
    encode: Callable[[str], list[int]], task: Task, system: str = SYSTEM
) -> tuple[list[int], list[PromptPart]]:
    """The task through the chat template (ChatML: system, then the user turn holding the
    documents and the question), as plain token ids and as the same ids in parts: the system
    turn the shared prefix, each document (and its blank line) a reusable part, the question
    computed every time (with the reply's lead, if any)."""
    head = encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n")
    docs = [encode(d + "\n\n") for d in task.docs]
    tail = encode(f"Question: {task.question}<|im_end|>\n<|im_start|>assistant\n{task.lead}")
    parts = [PromptPart(head, prefix=True), *map(PromptPart, docs), PromptPart(tail, False)]
    return head + sum(docs, []) + tail, parts
