from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from llmgw.testing import fake_wheel


def test_the_wheel_installs_with_pip_and_runs_the_fake_as_vllm(tmp_path: Path) -> None:
    wheel = fake_wheel.build_vllm_wheel(tmp_path / "wheels", "0.9.2")
    assert wheel.name == "vllm-0.9.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as whl:
        assert whl.testzip() is None
        record = whl.read("vllm-0.9.2.dist-info/RECORD").decode()
    assert "vllm/__init__.py,sha256=" in record

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The outer pip fills the bare venv (quicker than ensurepip); the agent's own run uses
    # the venv's pip, and the end-to-end test covers that.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--no-index", "--find-links", str(wheel.parent), "--disable-pip-version-check",
         "vllm==0.9.2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    imported = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert imported.stdout.strip() == "0.9.2"
    # The venv's console script runs the fake engine, which takes "vllm" from its name.
    script = venv / "bin" / "vllm"
    assert script.read_text().startswith(f"#!{venv / 'bin' / 'python'}")
    helped = subprocess.run(
        [str(script), "serve", "--help"], capture_output=True, text=True, timeout=30
    )
    assert helped.returncode == 0, helped.stderr
    assert "--max-num-seqs" in helped.stdout and "--served-model-name" in helped.stdout
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0
    assert fake_wheel.DEFAULT_VERSION in version.stdout
