"""Config resolution that is more than a default: the passage-states switches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from service.config import Config, load_config


def test_write_back_auto_means_the_embedded_engine_or_states_at_ingest() -> None:
    """With OpenSearch a write-back rewrites the chunk's document: auto turns it on there only
    beside states at ingest (it then fills the chunks ingest left without)."""
    assert Config().states_write_back is True
    on_os = dataclasses.replace(Config(), opensearch_url="http://127.0.0.1:9200")
    assert on_os.states_write_back is True
    assert dataclasses.replace(on_os, rerank_states="false").states_write_back is False
    assert dataclasses.replace(on_os, rerank_states="false", rerank_states_write_back="true").states_write_back is True
    assert dataclasses.replace(on_os, rerank_states_write_back="false").states_write_back is False
    assert dataclasses.replace(Config(), rerank_states_write_back=False).states_write_back is False  # type: ignore[arg-type]


def test_write_back_from_the_environment_and_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRIEVAL_RERANK_STATES_WRITE_BACK", "off")
    assert load_config(None).states_write_back is False
    with pytest.raises(ValueError, match="rerank_states_write_back"):
        _ = dataclasses.replace(Config(), rerank_states_write_back="sometimes").states_write_back


def test_states_at_ingest_auto_means_opensearch_only() -> None:
    """With OpenSearch a write-back rewrites the chunk's document, so vectors are stored at
    ingest there; the embedded engine stores what reranks compute and ingest pays nothing."""
    assert Config().states_at_ingest is False
    on_os = dataclasses.replace(Config(), opensearch_url="http://127.0.0.1:9200")
    assert on_os.states_at_ingest is True
    assert dataclasses.replace(on_os, rerank_states=False).states_at_ingest is False  # type: ignore[arg-type]
    assert dataclasses.replace(Config(), rerank_states=True).states_at_ingest is True  # type: ignore[arg-type]


def test_states_at_ingest_from_toml_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("rerank_states = true\n")
    assert load_config(toml).states_at_ingest is True
    monkeypatch.setenv("RETRIEVAL_RERANK_STATES", "false")
    assert load_config(toml, opensearch_url="http://127.0.0.1:9200").states_at_ingest is False
    with pytest.raises(ValueError, match="rerank_states must be"):
        _ = dataclasses.replace(Config(), rerank_states="sometimes").states_at_ingest
