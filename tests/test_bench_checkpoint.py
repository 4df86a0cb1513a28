"""bench.common.Checkpoint: a long benchmark cut short resumes from its finished units, on a
real file; other settings, or a unit cut mid-write, are not taken for done work."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.common import Checkpoint

units = st.lists(
    st.lists(st.fixed_dictionaries({"q": st.integers(0, 50), "x": st.floats(0, 1)}), min_size=1),
    max_size=8,
    unique_by=lambda u: u[0]["q"],
)


@settings(max_examples=50, deadline=None)
@given(units, st.integers(0, 40))
def test_resume_keeps_whole_units_only(tmp_path_factory, done: list, cut: int) -> None:
    path = tmp_path_factory.mktemp("ck") / "run.jsonl.tmp"
    ck = Checkpoint(path, {"n": 1})
    for u in done:
        ck.add(u)
    assert Checkpoint(path, {"n": 1}).done == {u[0]["q"]: u for u in done}
    # a unit cut mid-write is dropped, and later units still resume after it
    text = path.read_text()
    path.write_text(text + '[{"q": 99, "x": 0.'[: cut % 14])
    again = Checkpoint(path, {"n": 1})
    assert again.done == {u[0]["q"]: u for u in done}
    again.add([{"q": 100, "x": 1.0}])
    assert Checkpoint(path, {"n": 1}).done == {u[0]["q"]: u for u in done} | {
        100: [{"q": 100, "x": 1.0}]
    }
    # other settings: nothing is done
    assert Checkpoint(path, {"n": 2}).done == {}
    assert Checkpoint(path, {"n": 1}).done == {}


def test_remove(tmp_path: Path) -> None:
    ck = Checkpoint(tmp_path / "a.tmp", {})
    ck.add([{"q": 0}])
    ck.remove()
    assert not (tmp_path / "a.tmp").exists()
