"""Query-passage pairs the split cross-encoder tests score: en and zh, a relevant and an
irrelevant passage for one query, and a pair long enough to be truncated."""

from __future__ import annotations

SPLIT_PAIRS = [
    ("what is term life insurance", "Term life insurance pays a benefit if you die during the term."),
    ("what is term life insurance", "Car insurance covers damage to your vehicle."),
    ("如何申请理赔", "申请理赔时需要提交发票和诊断证明。"),
    ("q " * 40, "a much longer passage " * 40),
]
