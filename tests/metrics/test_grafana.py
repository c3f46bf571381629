"""docs/grafana/kvoffload.json: every PromQL expression of the dashboard names series the
collector exports, with labels those series carry (issue 24, point 5)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from support import small_config

from kvoffload import metrics
from kvoffload.core.offload import OffloadCore
from kvoffload.pools import DevicePool, HostPool

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvoffload.json"
#: PromQL's functions and aggregations the dashboard may call.
FUNCTIONS = {
    "rate",
    "irate",
    "increase",
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "histogram_quantile",
    "label_values",
    "clamp_min",
    "topk",
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
#: Labels Prometheus adds to every scraped series (and ``le`` of a histogram's buckets).
TARGET_LABELS = {"instance", "job"}


def exported() -> dict[str, set[str]]:
    """Each series name the collector exports -> its label names, from a real collector."""
    device = DevicePool.create(8, 4, (1,), "float32")
    host = HostPool.new(8, (4, 1), "float32")
    core = OffloadCore(small_config(), device_pool=device, host_pool=host, accept=lambda t: None)
    out: dict[str, set[str]] = {}
    for fam in metrics.KVOffloadCollector(core, tp_rank=0).collect():
        labels = set(metrics.METRICS[fam.name + ("_total" if fam.type == "counter" else "")][1]) | {"tp_rank"}
        if fam.type == "counter":
            out[fam.name + "_total"] = labels
        elif fam.type == "histogram":
            out[fam.name + "_bucket"] = labels | {"le"}
            out[fam.name + "_sum"] = out[fam.name + "_count"] = labels
        else:
            out[fam.name] = labels
    return out


def expressions(dash: dict[str, Any]) -> list[str]:
    exprs = []
    stack: list[Any] = list(dash.get("panels", []))
    while stack:
        panel = stack.pop()
        stack += panel.get("panels", [])
        exprs += [t["expr"] for t in panel.get("targets", [])]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if var.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def parse(expr: str) -> tuple[list[tuple[str, set[str]]], set[str], set[str]]:
    """(each series named with the labels its matchers name, the grouping labels, the
    functions called) of one expression. Label values (strings), range durations and
    Grafana variables are dropped first."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\[[^\]]*\]", "", text)
    series: list[tuple[str, set[str]]] = []

    def matchers(m: re.Match[str]) -> str:
        series.append((m.group(1), set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", m.group(2)))))
        return " "

    text = re.sub(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", matchers, text)
    grouping: set[str] = set()

    def groups(m: re.Match[str]) -> str:
        grouping.update(x.strip() for x in m.group(2).split(",") if x.strip())
        return " "

    text = re.sub(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)", groups, text)
    if "label_values" in text:  # label_values(metric, label): the label is a grouping label
        for m in re.finditer(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)", text):
            series.append((m.group(1), set()))
            grouping.add(m.group(2))
        text = re.sub(r"label_values\([^)]*\)", "label_values()", text)
    called = set(re.findall(r"([a-zA-Z_]\w*)\s*\(", text))
    bare = set(re.findall(r"(?<![\w.$])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()", text)) - KEYWORDS
    series += [(name, set()) for name in bare if not re.fullmatch(r"[0-9.e+-]+", name)]
    return series, grouping, called


def test_dashboard_is_grafana_json() -> None:
    """The file is a dashboard Grafana imports: a title, a uid, panels with PromQL
    targets on a Prometheus datasource variable."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and dash["schemaVersion"] >= 30
    targets = [t for p in dash["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 15
    assert all(t["datasource"]["type"] == "prometheus" for t in targets)
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in dash["templating"]["list"])


def test_every_dashboard_expression_names_exported_series() -> None:
    """Every name an expression reads is a series the collector exports (a counter's
    ``_total``, a histogram's ``_bucket``/``_sum``/``_count``), every function is
    PromQL's, every label matched or grouped by is one those series carry (or one
    Prometheus adds: instance, job) - and every exported family is on the dashboard."""
    names = exported()
    used: set[str] = set()
    for expr in expressions(json.loads(DASHBOARD.read_text())):
        series, grouping, called = parse(expr)
        assert series, f"names no series: {expr}"
        assert called <= FUNCTIONS, (expr, called - FUNCTIONS)
        carried: set[str] = set(TARGET_LABELS)
        for name, labels in series:
            assert name in names, f"{name!r} is not exported (in {expr})"
            assert labels <= names[name] | TARGET_LABELS, (expr, name, labels - names[name])
            carried |= names[name]
            used.add(name)
        assert grouping <= carried, (expr, grouping - carried)
    families = {n.removesuffix("_total").removesuffix("_bucket") for n in used}
    for name, (kind, _, _) in metrics.METRICS.items():
        base = name.removesuffix("_total") if kind == "counter" else name
        assert base in families, f"{name} is on no panel"


@pytest.mark.parametrize(
    "bad",
    [
        "sum(rate(kvoffload_transfer_byte_total[5m]))",  # a misspelt name
        "sum by (direction) (kvoffload_lifecycles)",  # a label the series lacks
        'kvoffload_pages_total{reason="host_full"}',  # a matcher on a label it lacks
        "rate(kvoffload_release_delay_seconds[5m])",  # a histogram's family, not a series
    ],
)
def test_the_check_catches_a_wrong_expression(bad: str) -> None:
    """The parser is not a check that cannot fail: each of these is refused."""
    names = exported()
    series, grouping, _ = parse(bad)
    carried = set(TARGET_LABELS).union(*(names.get(n, set()) for n, _ in series))
    known = all(n in names and labels <= names[n] | TARGET_LABELS for n, labels in series)
    ok = known and grouping <= carried
    assert not ok
