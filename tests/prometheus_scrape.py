"""Reading a server's Prometheus /metrics page in tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """{(sample name, sorted labels): value} of http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly these labels (0.0 when absent)."""
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)
