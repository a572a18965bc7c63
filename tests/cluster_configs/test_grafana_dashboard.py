"""cluster_configs/grafana/ray_pp_dashboard.json: it parses, uses a datasource variable as
Ray's own dashboards do, and every series its PromQL reads is one the engine exports
(ray_runtime/metrics.py's METRICS under Ray's `ray_` namespace, with the suffix its kind
gets in Prometheus), with labels that series carries. A renamed metric fails here."""
import json
import os
import re

import pytest

from ray_runtime.metric_defs import METRICS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "cluster_configs", "grafana", "ray_pp_dashboard.json")
# Labels Ray's exporter and Prometheus add to every series.
RAY_LABELS = {"SessionName", "NodeAddress", "Component", "Version", "WorkerId", "instance", "job",
              "ray_io_cluster"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                "unless", "bool", "offset"}
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


def exported_series() -> dict[str, set[str]]:
    """Prometheus series name -> the labels it carries, from METRICS."""
    out = {}
    for d in METRICS:
        for suffix in SUFFIXES[d.kind]:
            labels = set(d.tag_keys) | RAY_LABELS | ({"le"} if suffix == "_bucket" else set())
            out["ray_" + d.ray_name + suffix] = labels
    return out


def parse_promql(expr: str) -> tuple[list[tuple[str, set[str]]], set[str]]:
    """([(series name, labels matched in its {...})], labels named in by/without/on clauses).
    Enough PromQL for dashboards: selectors, functions, aggregations, arithmetic."""
    expr = re.sub(r"\$\w+", "x", expr)  # Grafana variables ($__rate_interval, $engine)
    grouping = set()
    for m in re.finditer(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        grouping |= {w.strip() for w in m.group(1).split(",") if w.strip()}
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range durations
    selectors = []
    pos = 0
    token = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
    while True:
        m = token.search(expr, pos)
        if m is None:
            break
        name, pos = m.group(0), m.end()
        rest = expr[pos:].lstrip()
        if rest.startswith("("):  # a function or aggregation
            continue
        if name in PROMQL_WORDS:
            continue
        matchers = set()
        if rest.startswith("{"):
            body = rest[1:rest.index("}")]
            matchers = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", body))
            pos = expr.index("}", pos) + 1
        selectors.append((name, matchers))
    return selectors, grouping


def targets(dashboard: dict):
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"]


@pytest.fixture(scope="module")
def dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def test_parser_finds_series_and_labels():
    sel, grp = parse_promql('histogram_quantile(0.9, sum by (le, pp_rank) '
                            '(rate(foo_bucket{engine=~"$engine",a="b"}[$__rate_interval]))) / bar')
    assert sel == [("foo_bucket", {"engine", "a"}), ("bar", set())] and grp == {"le", "pp_rank"}


def test_every_series_is_exported_with_its_labels(dashboard):
    series = exported_series()
    seen = set()
    for title, expr in targets(dashboard):
        selectors, grouping = parse_promql(expr)
        assert selectors, (title, expr)
        labels = set()
        for name, matchers in selectors:
            assert name in series, f"{title!r}: {name} is not a series ray_runtime/metrics.py exports"
            assert matchers <= series[name], (title, name, matchers - series[name])
            labels |= series[name]
            seen.add(name)
        assert grouping <= labels, (title, grouping - labels)
    # Every metric of the engine has a panel (any of its series).
    for d in METRICS:
        assert any(s.startswith("ray_" + d.ray_name) for s in seen), d.name


def test_a_renamed_metric_would_fail():
    series = exported_series()
    assert "ray_ray_pp_generation_tokens_total" in series
    assert "ray_ray_pp_generation_tokens" not in series  # a counter only as _total
    assert "ray_pp_generation_tokens_total" not in series  # Ray's namespace is required
    assert "ray_ray_pp_time_to_first_token_seconds_bucket" in series


def test_datasource_variable_and_filters(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for title, expr in targets(dashboard):
        for name, matchers in parse_promql(expr)[0]:
            assert {"model_name", "engine"} <= matchers, (title, name)
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            for t in panel["targets"]:
                assert t["datasource"]["uid"] == "${datasource}", panel["title"]
    series = exported_series()
    for name in ("model_name", "engine"):  # label_values(<selector>, <label>)
        q = variables[name]["query"]["query"]
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", q)
        assert m and m.group(2) == name, q
        selectors = parse_promql(m.group(1))[0]
        assert selectors and all(s in series and name in series[s] for s, _ in selectors), q


def test_panels_do_not_overlap(dashboard):
    cells = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, panel["title"]
        cells |= mine
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
