from __future__ import annotations

from service.ingest.chunking import chunk_document
from service.ingest.documents import DocumentInput, validate_document


def test_headings_become_breadcrumbs_and_children_keep_their_parent() -> None:
    text = "# A\nintro text.\n\n## B\n" + "Sentence one is here. " * 40 + "\n\n# C\nlast."
    chunks = chunk_document(text, "KB", "doc", child_chars=200, parent_chars=600)
    crumbs = [c.breadcrumb for c in chunks]
    assert crumbs[0] == "KB > A" and crumbs[-1] == "KB > C"
    assert "KB > A > B" in crumbs
    for c in chunks:
        assert len(c.text) <= 200
        assert c.text in c.parent_text
        assert len(c.parent_text) <= 600
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_chinese_sentences_split_and_faq_never_splits() -> None:
    zh = "第一句话很长。" * 60
    chunks = chunk_document(zh, "", "doc", child_chars=100, parent_chars=400)
    assert len(chunks) > 3 and all(len(c.text) <= 100 for c in chunks)
    faq = chunk_document("Q? " + "answer. " * 200, "", "faq", child_chars=100, parent_chars=400)
    assert len(faq) == 1


def test_document_validation_names_fields() -> None:
    bad = DocumentInput(source_id="has space", version="", title="t", text=" ", collection="wiki", status="live")
    fields = {v.field for v in validate_document(bad)}
    assert fields == {"document.source_id", "document.version", "document.text",
                      "document.collection", "document.status"}


def test_content_hash_tracks_content_and_model() -> None:
    d = DocumentInput(source_id="s", version="v1", title="t", text="x", collection="doc")
    assert d.content_hash("m1") == d.content_hash("m1")
    assert d.content_hash("m1") != d.content_hash("m2")
    assert d.content_hash("m1") != DocumentInput(source_id="s", version="v1", title="t", text="y", collection="doc").content_hash("m1")


def test_version_numbers_are_not_sentence_breaks_and_chinese_joins_without_spaces() -> None:
    chunks = chunk_document("Version v2.4 adds SAML 2.0 support. Next sentence.", "", "doc", 30, 400)
    assert chunks[0].text.startswith("Version v2.4 adds SAML 2.0")
    zh = chunk_document("第一句。第二句。", "", "doc", 100, 400)
    assert zh[0].text == "第一句。第二句。"
