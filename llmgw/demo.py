"""`make demo`: a control plane and two agents on this machine, with their own PKI.

Everything lives in ./demo-state (certificates, configs, state, logs). Ctrl-C
stops every process cleanly. `--check` starts, shows the nodes and stops: the
test suite runs it so the demo stays true.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

from llmgw.testing.cluster import LocalCluster

NODES = ("demo-a", "demo-b")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.demo")
    parser.add_argument("--dir", type=Path, default=Path("demo-state"))
    parser.add_argument("--check", action="store_true", help="start, show, stop")
    args = parser.parse_args(argv)

    cluster = LocalCluster(args.dir.resolve(), heartbeat_interval_s=2.0)
    # The documented defaults when they are free, so the printed commands look familiar.
    if _port_free(7070):
        cluster.rpc_port = 7070
    if _port_free(8081):
        cluster.admin_port = 8081
    print(f"llmgw demo: certificates, configs and logs in {cluster.root}")
    cluster.setup(NODES)
    try:
        cluster.start_cp()
        for node in NODES:
            cluster.start_agent(node)
        cluster.wait_states(dict.fromkeys(NODES, "ready"), timeout=30)
        print(cluster.ctl("nodes").stdout)
        key_file = cluster.root / "cp" / "admin.key"
        venv_bin = Path(sys.executable).parent
        print("A control plane and two agents are running. Look at them with:\n")
        print(f"  export LLMGW_ADMIN_URL={cluster.admin_url}")
        print(f"  export LLMGW_ADMIN_KEY=$(cat {shlex.quote(str(key_file))})")
        print(f"  {venv_bin / 'llmgw'} ctl nodes            # or --json\n")
        print(f"Logs: {cluster.root}/*.log")
        if args.check:
            return 0
        print("Press Ctrl-C to stop.")
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        while all(p.alive() for p in [cluster.cp, *cluster.agents.values()] if p):
            time.sleep(0.5)
        print("a demo process ended on its own; see the logs", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping")
        return 0
    finally:
        cluster.stop_all()
        print("llmgw demo: stopped")


if __name__ == "__main__":
    sys.exit(main())
