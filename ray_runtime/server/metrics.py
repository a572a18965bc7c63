"""/metrics: the engine's `ray_pp` metrics and Ray Serve's request metrics, in Prometheus
text format, as Ray itself exports them.

The engine records its metrics through ray.util.metrics on the driver actor
(ray_runtime/metrics.py); Ray Serve records its own (`ray_serve_*`: HTTP requests, latencies,
replica queues) the same way. Ray's metrics agent on every node serves them at that node's
metrics export port (docs/operations.md). This endpoint scrapes the export port of every
alive node, keeps the families named `ray_ray_pp_*` and `ray_serve_*`, and merges them (one
HELP/TYPE per family; the series of different nodes differ by Ray's own labels). So it shows
exactly what a Prometheus scraping the cluster would, at Ray's export interval
(RAY_metrics_report_interval_ms, 10 s by default), without a second bookkeeping. Serving the
export port needs Ray's dashboard extras (`ray[default]`); without them no node answers and
the endpoint is a 503 saying so.
"""
from __future__ import annotations

import concurrent.futures
import re
import urllib.request
from typing import Iterable

import ray

PREFIXES = ("ray_ray_pp_", "ray_serve_")
_NAME = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)")


def export_urls() -> list[str]:
    """Every alive node's metrics export endpoint."""
    urls = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port:
            urls.append(f"http://{node['NodeManagerAddress']}:{port}/metrics")
    return urls


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode("utf-8", "replace")


def merge(texts: Iterable[str], prefixes: tuple[str, ...] = PREFIXES) -> str:
    """Prometheus texts merged family by family, keeping only the families whose name starts
    with one of `prefixes`; duplicate lines dropped."""
    families: dict[str, dict] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    f = families.setdefault(family, {"HELP": None, "TYPE": None, "samples": {}})
                    if f[parts[1]] is None:
                        f[parts[1]] = line
                continue
            m = _NAME.match(line)
            if m is None:
                continue
            name = family if family is not None and m.group(1).startswith(family) else m.group(1)
            f = families.setdefault(name, {"HELP": None, "TYPE": None, "samples": {}})
            f["samples"][line] = None
    out = []
    for name, f in families.items():
        if not name.startswith(prefixes) or not f["samples"]:
            continue
        out.extend(x for x in (f["HELP"], f["TYPE"]) if x is not None)
        out.extend(f["samples"])
    return "\n".join(out) + "\n" if out else ""


def scrape(timeout_s: float = 5.0) -> tuple[str, list[str]]:
    """(merged text, the export URLs that could not be read). Blocking: run it in a thread."""
    urls = export_urls()
    texts, failed = [], []
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, len(urls)))) as pool:
        futures = {pool.submit(_fetch, u, timeout_s): u for u in urls}
        for fut, url in futures.items():
            try:
                texts.append(fut.result())
            except Exception:  # noqa: BLE001 - a node without a metrics agent
                failed.append(url)
    return merge(texts), failed
