"""What the demo corpus must answer, whatever the engine behind the service.

One table for every suite that serves the demo corpus (tests/e2e against the embedded
engine, tests/integration against a real OpenSearch node), so the engines are held to the
same expectations instead of copies that drift apart.
"""

from __future__ import annotations

from typing import Any

from service._gen.retrieval.v1 import retrieval_pb2, types_pb2

# (query, source that must rank first): English and Chinese.
RANKING_CASES: list[tuple[str, str]] = [
    ("how do I reset my password", "kb-password-reset"),
    ("I forgot my password and the reset link expired", "kb-password-reset"),
    ("can I get a PDF invoice", "kb-billing"),
    ("how long are deleted files kept", "kb-data-retention"),
    ("如何开具发票", "faq-invoice-zh"),
    ("退款需要多长时间审核", "kb-refund-zh"),
    ("怎么开启两步验证", "kb-security-zh"),
    ("免费版存储空间有多大", "faq-storage-zh"),
]

# (query, version of "release-notes" that must rank first).
VERSION_CASES: list[tuple[str, str]] = [
    ("what is new in v2.4", "v2.4"),
    ("release notes v2.3", "v2.3"),
    ("v2.4 SSO SAML", "v2.4"),
]

# Outcomes produced by data and policy: (id, Retrieve request fields, expected outcome).
EMPTY_REQUEST: dict[str, Any] = {
    "query": "password", "top_k": 3, "filters": retrieval_pb2.Filters(source_ids=["no-such-source"])}
INSUFFICIENT_REQUEST: dict[str, Any] = {
    "query": "zebra migration patterns", "top_k": 3, "options": retrieval_pb2.RetrievalOptions(min_quality=0.99)}
DRAFT_ONLY_REQUEST: dict[str, Any] = {
    "query": "Quantum tier price per seat", "top_k": 3,
    "filters": retrieval_pb2.Filters(source_ids=["pricing-2027", "legacy-fax-support"])}
WRONG_PIN_REQUEST: dict[str, Any] = {
    "query": "release notes", "top_k": 3, "version_pins": {"release-notes": "v9.9"},
    "filters": retrieval_pb2.Filters(source_ids=["release-notes"])}
USER_INFO_GAP_REQUEST: dict[str, Any] = {
    "query": "what is my account email", "top_k": 3, "gap": retrieval_pb2.EvidenceGap(
        gap_id="g-1", kind=types_pb2.GAP_KIND_USER_INFORMATION, question="user's email")}

OUTCOME_CASES: list[tuple[str, dict[str, Any], int]] = [
    ("empty", EMPTY_REQUEST, types_pb2.ATTEMPT_OUTCOME_EMPTY),
    ("insufficient", INSUFFICIENT_REQUEST, types_pb2.ATTEMPT_OUTCOME_INSUFFICIENT),
    ("inadmissible-draft", DRAFT_ONLY_REQUEST, types_pb2.ATTEMPT_OUTCOME_INADMISSIBLE),
    ("inadmissible-pin", WRONG_PIN_REQUEST, types_pb2.ATTEMPT_OUTCOME_INADMISSIBLE),
    ("permission-denied", USER_INFO_GAP_REQUEST, types_pb2.ATTEMPT_OUTCOME_PERMISSION_DENIED),
]

# ACL: "internal-escalation" is visible to the "support" group only.
ACL_SOURCE = "internal-escalation"
ACL_GROUP = "support"
ACL_QUERY = "orion-pager escalation runbook"

# GetEvidence: both release-notes versions stay readable, exactly.
RELEASE_NOTES_VERSIONS = ["v2.3", "v2.4"]
