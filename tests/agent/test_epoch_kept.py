"""The newest leader epoch an agent has seen outlives the agent (issue 15's fencing).

A deposed control plane that is still running must find its commands refused
by every agent, including one restarted since it saw the new leader's epoch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent._servant import AgentServant, read_epoch, write_epoch
from llmgw.errors import ConfigError, StaleEpoch
from llmgw.testing import fake_engine
from llmgw.testing.cluster import LocalCluster, wait_for

TIMEOUT = 60


def _servant(path: Path) -> AgentServant:
    return AgentServant(None, None, epoch_path=path)  # type: ignore[arg-type]


def test_kept_across_a_restart_and_only_ever_raised(tmp_path: Path) -> None:
    path = tmp_path / "state" / "epoch"
    first = _servant(path)
    assert first.newest_epoch == 0 and not path.exists()
    first.saw_epoch(5)
    assert path.read_text() == "5\n"
    first.saw_epoch(3)  # an older epoch never lowers it
    assert read_epoch(path) == 5
    again = _servant(path)  # the agent restarted
    assert again.newest_epoch == 5
    with pytest.raises(StaleEpoch, match="command from epoch 4 refused: epoch 5 has been seen"):
        again._fence(4)
    again._fence(6)
    assert read_epoch(path) == 6


def test_an_unreadable_epoch_file_stops_the_agent_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "epoch"
    path.write_text("seven\n")
    with pytest.raises(ConfigError, match=r"epoch: holds 'seven', not an epoch"):
        _servant(path)
    write_epoch(path, 7)
    assert _servant(path).newest_epoch == 7


@pytest.mark.slow
def test_a_restarted_agent_refuses_an_older_epochs_command(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    llama = fake_engine.install(tmp_path / "bin", "llama-server")
    cluster.setup(["n1"])
    cluster.write_agent_config("n1", engine_paths={"llama-server": str(llama)})
    cluster.start_cp()
    agent = cluster.start_agent("n1")
    cluster.wait_states({"n1": "ready"}, TIMEOUT)
    epoch_file = cluster.root / "n1" / "epoch"
    # Registration told it the leader's epoch (1, with one control plane): kept (written
    # once the agent has the answer, which may be after the control plane lists it ready).
    wait_for("the epoch kept", lambda: read_epoch(epoch_file) == 1, TIMEOUT)
    started = cluster.ctl(
        "shard", "start", "n1", "--engine", "llama-server", "--model", "llmgw-test/tiny"
    )
    assert started.returncode == 0, started.stderr
    # The agent stops after a newer leader (epoch 5) was heard of, and comes back.
    agent.terminate()
    write_epoch(epoch_file, 5)
    cluster.start_agent("n1")
    cluster.wait_states({"n1": "ready"}, TIMEOUT)
    refused = cluster.ctl(
        "shard",
        "start",
        "n1",
        "--engine",
        "llama-server",
        "--model",
        "llmgw-test/tiny",
        check=False,
    )
    assert refused.returncode != 0
    assert "command from epoch 1 refused: epoch 5 has been seen" in refused.stderr, (
        refused.stdout + refused.stderr
    )
    assert read_epoch(epoch_file) == 5  # the older leader's registration lowered nothing
