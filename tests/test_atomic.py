"""jaxscale.infra.atomic.replace_between: the generated block of a Markdown file, replaced between its markers."""

import pytest

from jaxscale.infra import atomic

START, END = "<!-- x:begin -->", "<!-- x:end -->"


def test_replace_between_rewrites_only_the_text_between_the_markers(tmp_path):
    doc = tmp_path / "doc.md"
    head, tail = "# Title\n\nkept  \r\n text\n", "\n\nafter <!-- x:end --> too\n"
    doc.write_text(f"{head}{START}\nold\nblock\n{END}{tail}")
    atomic.replace_between(doc, START, END, "new\nbody")
    assert doc.read_bytes() == f"{head}{START}\nnew\nbody\n{END}{tail}".encode()  # the rest byte for byte
    atomic.replace_between(doc, START, END, "new\nbody")
    assert doc.read_bytes() == f"{head}{START}\nnew\nbody\n{END}{tail}".encode()  # idempotent


MISSING = [("no markers", START), (f"{START} only the start", END), (f"{END} {START}", END)]


@pytest.mark.parametrize("text, missing", MISSING)
def test_replace_between_names_the_file_and_the_missing_marker(tmp_path, text, missing):
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    with pytest.raises(ValueError, match=f"{doc}.*{missing}"):
        atomic.replace_between(doc, START, END, "body")
    assert doc.read_text() == text
    with pytest.raises(ValueError, match=f"{tmp_path / 'absent.md'}.*{START}"):
        atomic.replace_between(tmp_path / "absent.md", START, END, "body")
