"""`llmgw-cp` as a real process: what its start-up line says."""

from __future__ import annotations

import pytest

from llmgw.testing.cluster import LocalCluster, wait_for


@pytest.mark.slow
def test_the_start_up_line_names_the_rpc_port(cluster: LocalCluster) -> None:
    cluster.setup([])
    assert len({cluster.rpc_port, cluster.router_port, cluster.admin_port}) == 3
    cluster.start_cp()
    assert cluster.cp is not None
    cp = cluster.cp

    def ready_line() -> str | None:
        return next((x for x in cp.output().splitlines() if "control plane ready" in x), None)

    line = wait_for("the start-up line", ready_line, 10)
    # It named the router's port as the agents' before: `port` was reused.
    assert f"agents on 127.0.0.1:{cluster.rpc_port}," in line, line
    assert f"admin API on http://127.0.0.1:{cluster.admin_port}" in line
    router = next(x for x in cp.output().splitlines() if "router: OpenAI API" in x)
    assert f"http://127.0.0.1:{cluster.router_port}/v1" in router
