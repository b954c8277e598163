"""Config resolution that is more than a default: the write-back switch."""

from __future__ import annotations

import dataclasses

import pytest

from service.config import Config, load_config


def test_write_back_auto_means_the_embedded_engine_only() -> None:
    assert Config().states_write_back is True
    assert dataclasses.replace(Config(), opensearch_url="http://127.0.0.1:9200").states_write_back is False
    on_os = dataclasses.replace(Config(), opensearch_url="http://127.0.0.1:9200", rerank_states_write_back="true")
    assert on_os.states_write_back is True
    assert dataclasses.replace(Config(), rerank_states_write_back=False).states_write_back is False  # type: ignore[arg-type]


def test_write_back_from_the_environment_and_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRIEVAL_RERANK_STATES_WRITE_BACK", "off")
    assert load_config(None).states_write_back is False
    with pytest.raises(ValueError, match="rerank_states_write_back"):
        _ = dataclasses.replace(Config(), rerank_states_write_back="sometimes").states_write_back
