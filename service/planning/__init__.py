"""Retrieval plans: intent signals -> a RetrievalPlan, by layered rules kept as data.

rules.py loads and validates the TOML rules; classifier.py supplies intent when the caller
gives none; planner.py applies the layers. Nothing here searches: the attempt pipeline
executes a plan (service/pipeline/plan_execution.py).
"""
