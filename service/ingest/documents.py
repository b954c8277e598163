"""Document input, validation and content hashing."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from service.domain import COLLECTIONS, STATUSES
from service.errors import FieldViolation

_ID = re.compile(r"^[A-Za-z0-9._:/\-]{1,200}$")
MAX_TEXT_CHARS = 2_000_000


@dataclass(frozen=True)
class DocumentInput:
    source_id: str
    version: str
    title: str
    text: str
    collection: str
    status: str = "approved"
    acl: tuple[str, ...] = ()
    breadcrumb: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    def content_hash(self, model_key: str) -> str:
        """Changes when anything indexed changes, including the embedding model."""
        payload = json.dumps(
            [self.title, self.text, self.collection, self.status, sorted(self.acl),
             self.breadcrumb, sorted(self.metadata.items()), model_key],
            ensure_ascii=False,
        )
        return hashlib.sha256(payload.encode()).hexdigest()


def validate_document(doc: DocumentInput, prefix: str = "document") -> list[FieldViolation]:
    v = []
    if not _ID.match(doc.source_id):
        v.append(FieldViolation(f"{prefix}.source_id", "required; 1-200 of letters, digits and ._:/-"))
    if not _ID.match(doc.version):
        v.append(FieldViolation(f"{prefix}.version", "required; 1-200 of letters, digits and ._:/-"))
    if not doc.text.strip():
        v.append(FieldViolation(f"{prefix}.text", "must not be empty"))
    elif len(doc.text) > MAX_TEXT_CHARS:
        v.append(FieldViolation(f"{prefix}.text", f"longer than {MAX_TEXT_CHARS} characters"))
    if doc.collection not in COLLECTIONS:
        v.append(FieldViolation(f"{prefix}.collection", f"must be one of {', '.join(COLLECTIONS)}"))
    if doc.status not in STATUSES:
        v.append(FieldViolation(f"{prefix}.status", f"must be one of {', '.join(STATUSES)}"))
    if len(doc.title) > 1000:
        v.append(FieldViolation(f"{prefix}.title", "at most 1000 characters"))
    for g in doc.acl:
        if not g.strip():
            v.append(FieldViolation(f"{prefix}.acl", "groups must not be empty"))
    for k in doc.metadata:
        if not k.strip() or "." in k:
            v.append(FieldViolation(f"{prefix}.metadata", f"invalid key {k!r} (empty or containing '.')"))
    return v


def document_from_json(obj: Any) -> DocumentInput:
    """One JSONL line -> DocumentInput (shape errors surface as validation errors)."""
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    acl = obj.get("acl") or []
    meta = obj.get("metadata") or {}
    if not isinstance(acl, list) or not isinstance(meta, dict):
        raise ValueError("acl must be a list and metadata an object")
    return DocumentInput(
        source_id=str(obj.get("source_id", "")),
        version=str(obj.get("version", "")),
        title=str(obj.get("title", "")),
        text=str(obj.get("text", "")),
        collection=str(obj.get("collection", "doc")),
        status=str(obj.get("status", "approved")),
        acl=tuple(str(g) for g in acl),
        breadcrumb=str(obj.get("breadcrumb", "")),
        metadata={str(k): str(v) for k, v in meta.items()},
    )
