"""The pydoc task set (engine/blend_tasks.py): every question's answer is stated by exactly one
of its 2-8 documents, which are cut to the budget, in seeded orders; the answer check. SmolLM2's
tokenizer only; no model forward."""

from __future__ import annotations

import pytest

from tierkv.engine import blend_tasks
from tierkv.engine.gguf_loader import load_tokenizer
from tierkv.engine.models import pull


@pytest.fixture(scope="module")
def count():
    tok = load_tokenizer(pull("smollm2", progress=False))
    return lambda s: len(tok.encode(s, add_special_tokens=False))


def test_sixty_questions_each_answered_by_one_document(count) -> None:
    tasks = blend_tasks.tasks(count, 60, (2, 3, 4, 5, 6, 7, 8), 250, seed=0)
    assert len(tasks) == 60 and len({t.question for t in tasks}) == 60
    assert {len(t.docs) for t in tasks} == set(range(2, 9))
    for t in tasks:
        holding = [i for i, d in enumerate(t.docs) if blend_tasks.holds(d, t.answer)]
        assert holding == [t.about], t
        assert all(count(d) <= 250 for d in t.docs)
        assert t.docs[t.about].startswith("Python Library Documentation: ")
    assert sum(t.about == 0 for t in tasks) < 30  # the answering page is shuffled in
    again = blend_tasks.tasks(count, 60, (2, 3, 4, 5, 6, 7, 8), 250, seed=0)
    assert again == tasks  # deterministic for a seed
    assert blend_tasks.tasks(count, 60, (2, 3, 4, 5, 6, 7, 8), 250, seed=1) != tasks


def test_answer_check_is_a_normalised_whole_word_match() -> None:
    t = blend_tasks.Task("q", "15", ("doc",), 0, "pydoc")
    assert blend_tasks.correct(" 15\n\nThe value", t)
    assert blend_tasks.correct("It is '15'.", t)
    assert not blend_tasks.correct(" 150", t) and not blend_tasks.correct("1.15", t)
    assert not blend_tasks.correct("15.5", t)
    w = blend_tasks.Task("q", "strict", ("doc",), 0, "pydoc")
    assert blend_tasks.correct("The value is 'STRICT'", w) and not blend_tasks.correct(
        "strictly", w
    )


def test_two_replies_agree_on_their_first_line_only() -> None:
    a = blend_tasks.answer
    assert a(" 15\n\nThe value of MAX_WBITS") == a("15.\nIt is the window size.") == "15"
    assert a("\n 'Strict'") == "strict"  # quotes and case normalised, blank lines skipped
    assert a(" 15") != a(" 150") and a(" 15") != a(" 1.5")
    assert a("") == a("\n\n") == ""


def test_facts_are_read_from_data_and_signatures() -> None:
    lines = [
        "DATA",
        "    MAX_WBITS = 15",
        "    name = 'x y'",
        "FUNCTIONS",
        "    fill(text, width=70)",
    ]
    got = blend_tasks.facts("zlib", lines)
    assert [(f.name, f.answer, f.lead) for f in got] == [
        ("MAX_WBITS", "15", "MAX_WBITS ="),
        ("width=", "70", "The default value of width is"),
    ]
