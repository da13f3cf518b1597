"""A MIG-enabled H100 through real processes: llmgw-cp and an llmgw-agent whose
nvidia-smi is the fake answering the recorded h100-mig capture (-L and -q;
tests/data/INDEX.md). The instances reach the control plane as recorded and
`ctl nodes --json` shows them; a pending mode change is the node's warning."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from helpers import mig_agent_env

from llmgw.testing import fake_nvidia_smi
from llmgw.testing.cluster import LocalCluster, wait_for


def test_mig_instances_reach_the_control_plane(cluster: LocalCluster, tmp_path: Path) -> None:
    bin_dir = tmp_path / "gpu-bin"
    fake_nvidia_smi.install(bin_dir)
    cluster.setup(["mig-1"])
    cluster.start_cp()
    cluster.start_agent(
        "mig-1", env=mig_agent_env(bin_dir, LLMGW_FAKE_SMI_MIG_PENDING="0:Disabled")
    )
    wait_for("mig-1 ready", lambda: cluster.states().get("mig-1") == "ready", 30)
    node = json.loads(cluster.ctl("nodes", "--json").stdout)
    (mig1,) = [n for n in node["nodes"] if n["node_id"] == "mig-1"]
    (gpu,) = mig1["inventory"]["gpus"]
    assert (gpu["mig_mode"], gpu["mig_pending"]) == ("enabled", "disabled")
    assert [
        (d["uuid"], d["profile"], d["memory_mib"], d["gpu_instance"], d["compute_instance"])
        for d in gpu["mig_devices"]
    ] == [
        ("MIG-00000000-0000-0000-0000-000000000000", "3g.40gb", 40448, 2, 0),
        ("MIG-00000001-0000-0000-0000-000000000001", "2g.20gb", 20096, 3, 0),
        ("MIG-00000002-0000-0000-0000-000000000002", "1g.10gb", 9984, 9, 0),
        ("MIG-00000003-0000-0000-0000-000000000003", "1g.10gb", 9984, 10, 0),
    ]
    assert (
        "gpu 0: MIG mode change pending a GPU reset (enabled -> disabled)"
        in mig1["inventory"]["warnings"]
    )
    # The table and the node page say it compactly.
    table = cluster.ctl("nodes").stdout
    row = next(line for line in table.splitlines() if line.startswith("mig-1"))
    assert "1xh100-80g; gpu 0 MIG 3g.40gb,2g.20gb,2x1g.10gb" in row
    with httpx.Client(base_url=cluster.admin_url, timeout=10) as client:
        r = client.post("/admin/login", data={"key": cluster.admin_key})
        assert r.status_code in (200, 303), r.text
        page = client.get("/admin/nodes/mig-1")
    assert page.status_code == 200
    assert (
        '<small data-field="gpu-mig">MIG 3g.40gb, 2g.20gb, 2x1g.10gb '
        "(disabled after a GPU reset)</small>" in page.text
    )
