"""The RAG demo's corpus (examples/rag_docs.py): pydoc pages cut at line boundaries to the token
budget, questions whose facts the documents they are asked over hold, and prompts in parts that
are the same token ids as the plain prompts. SmolLM2's tokenizer only; no model forward."""

from __future__ import annotations

import pytest

from examples.rag_docs import MODULES, QUESTION_A, QUESTIONS, Corpus, cut, documents, module_doc
from tierkv.engine.blend import join_parts
from tierkv.engine.gguf_loader import load_tokenizer
from tierkv.engine.models import pull
from tierkv.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(pull("smollm2", progress=False))


def test_cut_keeps_whole_lines_within_the_budget() -> None:
    text = "one two\nthree\nfour five six\nseven"
    words = lambda s: len(s.split())
    assert cut(text, words, 3) == "one two\nthree"
    assert cut(text, words, 5) == "one two\nthree"
    assert cut(text, words, 6) == "one two\nthree\nfour five six"
    assert cut(text, words, 1) == ""


def test_documents_are_plain_pydoc_pages_cut_to_the_budget(tok: Tokenizer) -> None:
    count = lambda s: len(tok.encode(s, add_special_tokens=False))
    docs = documents(count, 260)
    assert len(docs) == len(MODULES) == 6
    for name, doc in zip(MODULES, docs):
        assert doc.startswith(f"Python Library Documentation: module {name}\n")
        assert "\b" not in doc and "MODULE REFERENCE" not in doc
        assert module_doc(name).startswith(doc)
        assert 200 <= count(doc) <= 260, (name, count(doc))


def test_questions_are_asked_over_documents_that_answer_them(tok: Tokenizer) -> None:
    docs = documents(lambda s: len(tok.encode(s, add_special_tokens=False)), 260)
    assert len(QUESTIONS) >= 5
    for q in (QUESTION_A, *QUESTIONS):
        assert len(set(q.docs)) == len(q.docs)
        assert any(q.expect in docs[i].lower() for i in q.docs), q
    for q in QUESTIONS:
        assert 2 <= len(q.docs) <= 4 and q.docs != QUESTION_A.docs[: len(q.docs)]


def test_prompt_in_parts_is_the_plain_prompt(tok: Tokenizer) -> None:
    corpus = Corpus(tok)
    assert tok.decode(corpus.system, skip_special_tokens=False).startswith("<|im_start|>system\n")
    for q in (QUESTION_A, *QUESTIONS):
        tokens, spans, prefix = join_parts(corpus.parts(q), corpus.enc)
        assert tokens == corpus.flat(q) and prefix == len(corpus.system)
        assert [r for _, _, r in spans] == [False] + [True] * len(q.docs) + [False]
        text = tok.decode(tokens, skip_special_tokens=False)
        assert text.endswith(f"Question: {q.text}<|im_end|>\n<|im_start|>assistant\n")
