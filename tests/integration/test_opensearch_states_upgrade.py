"""An OpenSearch index created before cached passage states (its ``dynamic: strict``
mapping lacks ``rerank_states``) gets the two fields added in place when the engine starts,
and then stores and serves states like a new index. Real node only."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from opensearchpy import AsyncOpenSearch

from service.engines.opensearch import mapping
from service.engines.opensearch.engine import OpenSearchEngine
from tests.support.opensearch import drop_prefix, opensearch_url_or_skip, unique_prefix
from tests.unit.engines.test_engine_contract import chunk

pytestmark = pytest.mark.integration


async def test_old_index_gets_the_states_fields(request: pytest.FixtureRequest) -> None:
    url = opensearch_url_or_skip()
    prefix = unique_prefix("states")
    request.addfinalizer(lambda: drop_prefix(url, prefix))
    old = copy.deepcopy(mapping.index_template(prefix, 8, 1, 0))
    for name in mapping.STATES_PROPERTIES:
        del old["template"]["mappings"]["properties"][name]
    client = AsyncOpenSearch(hosts=[url])
    try:
        await client.indices.put_index_template(name=mapping.template_name(prefix), body=old)
        await client.indices.create(index=mapping.index_name(prefix, mapping.MAPPING_VERSION),
                                    body=mapping.create_index_body(prefix))
    finally:
        await client.close()
    engine = OpenSearchEngine(url, index_prefix=prefix, dimension=8)
    await engine.start()
    try:
        c = dataclasses.replace(chunk("S1", 0, "alpha policy"), rerank_states=b"\x00states\xff", rerank_states_key="k")
        report = await engine.replace_document("S1", "v1", [c])
        assert report.written == 1 and not report.errors, report
        assert await engine.passage_states([(c.chunk_id, c.content_hash)], "k") == {c.chunk_id: b"\x00states\xff"}
    finally:
        await engine.close()
