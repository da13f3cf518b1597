"""Each of the catalog's error messages, with its whole path (llmgw/cp/_fleet/_catalog.py)."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.cp._fleet._catalog import parse
from llmgw.errors import ConfigError

CPU = {"engine": "llama-server", "gpus_per_node": 0}


def model(**kw: Any) -> dict[str, Any]:
    return {"name": "m", "source": "/m.gguf", "profiles": [CPU], **kw}


def errors(*models: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse({"models": list(models)}, "server.yaml")
    return str(info.value).splitlines()


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        (
            [model(name="bad name")],
            "server.yaml: models[0].name: 'bad name': use letters, digits, '.', '_', '-'",
        ),
        ([model(), model()], "server.yaml: models[1].name: 'm' is defined twice"),
        (
            [model(), model(name="n", served_names=["m"])],
            "server.yaml: models[1].served_names: 'm' is also served by model 'm'",
        ),
        ([model(replicas=-1)], "server.yaml: models[0].replicas: -1 is negative"),
        ([model(profiles=[])], "server.yaml: models[0].profiles: at least one profile is needed"),
        (
            [model(profiles=[{"engine": "tgi"}])],
            "server.yaml: models[0].profiles[0].engine: unknown engine 'tgi' "
            "(known: vllm, sglang, llama-server)",
        ),
        (
            [model(profiles=[{"engine": "vllm", "gpu_class": "h100-80"}])],
            "server.yaml: models[0].profiles[0].gpu_class: unknown class 'h100-80' "
            "(a class is the card and its size in GiB, e.g. h100-80g, l40s-45g)",
        ),
        (
            [model(profiles=[{"engine": "vllm", "gpu_class": "h100-80g", "multinode": "mpi"}])],
            "server.yaml: models[0].profiles[0].multinode: 'mpi': use ray or native",
        ),
        (
            [model(profiles=[{**CPU, "port_range": [9000, 8000]}])],
            "server.yaml: models[0].profiles[0].port_range: [9000, 8000] is not [first, last] ports",
        ),
        (
            [model(profiles=[{**CPU, "port_range": [8000]}])],
            "server.yaml: models[0].profiles[0].port_range: [8000] is not [first, last] ports",
        ),
        (
            [model(profiles=[{**CPU, "startup_timeout_s": 0}])],
            "server.yaml: models[0].profiles[0].startup_timeout_s: must be positive",
        ),
        (
            [{"name": "m", "source": "/m", "profiles": [CPU], "replicaz": 2}],
            "server.yaml: models[0].replicaz: unknown key",
        ),
        (
            [{"name": "m", "profiles": [CPU]}],
            "server.yaml: models[0].source: required, but missing",
        ),
        (
            [model(replicas=2, autoscale={"max": 2})],
            "server.yaml: models[0]: replicas and autoscale are both set: autoscale sets the "
            "count between its min and max; leave replicas out",
        ),
        (
            [model(autoscale={"min": 3, "max": 2})],
            "server.yaml: models[0].autoscale.max: 2; must be at least min (3)",
        ),
        (
            [model(autoscale={"max": 2, "target": {"requests_per_replica": -1}})],
            "server.yaml: models[0].autoscale.target.requests_per_replica: -1.0; must be a "
            "positive number (or unset)",
        ),
        (
            [model(autoscale={"min": 1})],
            "server.yaml: models[0].autoscale.max: required, but missing",
        ),
        (
            [model(autoscale={"max": 2, "hold": 3})],
            "server.yaml: models[0].autoscale.hold: unknown key",
        ),
    ],
)
def test_each_catalog_error_is_one_line_with_its_path(
    models: list[dict[str, Any]], expected: str
) -> None:
    assert errors(*models) == [expected]


def test_the_engine_adapters_problems_come_with_the_profiles_path() -> None:
    lines = errors(model(profiles=[{"engine": "llama-server", "nodes": 2}]))
    assert lines and all(x.startswith("server.yaml: models[0].profiles[0]: ") for x in lines)
    assert any("llama-server" in x for x in lines), lines


def test_an_empty_source_is_named_by_the_catalog_and_by_the_engine_check() -> None:
    assert errors(model(source="")) == [
        "server.yaml: models[0].source: empty",
        "server.yaml: models[0].profiles[0]: model is empty: give a local path or a hub id",
    ]


def test_every_problem_is_reported_at_once() -> None:
    lines = errors(model(name="a b", replicas=-2), model(name="a b"))
    assert sorted(lines) == [
        "server.yaml: models[0].name: 'a b': use letters, digits, '.', '_', '-'",
        "server.yaml: models[0].replicas: -2 is negative",
        "server.yaml: models[1].name: 'a b' is defined twice",
        "server.yaml: models[1].name: 'a b': use letters, digits, '.', '_', '-'",
    ]


def test_a_good_catalog_parses() -> None:
    cat = parse({"models": [model(served_names=["m", "m-chat"], replicas=2)]}, "server.yaml")
    (m,) = cat.models
    assert (m.name, m.names, m.replicas, m.profiles[0].cards) == ("m", ("m", "m-chat"), 2, 0)
    assert cat.by_served_name() == {"m": m, "m-chat": m}
    assert parse({}, "server.yaml").models == ()
