"""Offline evaluation: judged data sets, IR metrics and a runner that drives the real service.

Needs the ``eval`` extra (``pip install '.[eval]'``) for the InsuranceQA data; a user's own
JSONL judgements need nothing extra.
"""
