"""Scrape a Prometheus /metrics endpoint into {(sample name, sorted labels): value}."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str, timeout: float = 5.0) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse(resp.read().decode("utf-8"))


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """Values of one sample name keyed by one label (e.g. attempts by outcome)."""
    return {dict(labels)[label]: v for (n, labels), v in samples.items() if n == name and label in dict(labels)}


def sample_names(samples: Samples) -> set[str]:
    return {n for n, _ in samples}
