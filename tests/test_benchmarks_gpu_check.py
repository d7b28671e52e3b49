"""benchmarks/gpu_check.sh --smoke: the prepared GPU check runs every step on the CPU and reports each one.

The GPU run happens only on a lent machine, once; this test keeps its code paths (steps, subprocesses,
report) working in between, so that run does not fail on something a CPU could have caught.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = ["environment", "emu35", "wavtokenizer", "batch_invariance", "e2e", "status", "calibrate", "cuda_context"]
# Every step has a CPU variant; status and calibrate may be skipped only where their command is missing.
MUST_RUN = ["environment", "emu35", "wavtokenizer", "batch_invariance", "e2e", "cuda_context"]


def test_smoke_check_reports_every_step(tmp_path):
    # Its duration (~50 s on an idle 2-core VM) is measured in benchmarks/RESULTS.md, not asserted here.
    run = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "smoke"
    assert list(report["steps"]) == STEPS
    for name, step in report["steps"].items():
        assert step["status"] in ("ok", "failed", "skipped"), name
        assert step["status"] != "failed", f"{name}: {step['error']}\n{step.get('log_tail', '')}"
    for name in MUST_RUN:
        assert report["steps"][name]["status"] == "ok", f"{name}: {report['steps'][name]['error']}"
    for name in ("status", "calibrate"):
        step = report["steps"][name]
        assert step["status"] == "ok" or step["error"] == f"mmtok {name} not available", step["error"]
    e2e = report["steps"]["e2e"]["results"]
    assert [part["images_written"] for part in e2e["parts"]] == [part["images_planned"] for part in e2e["parts"]]
    assert e2e["merged"]["sequences"] == e2e["corpus"]["images"]  # one caption document per image
    cases = report["steps"]["batch_invariance"]["results"]["invariance"]
    assert {case["codec"] for case in cases} == {"emu3.5", "wavtokenizer"}
    assert sorted({case["batch"] for case in cases if case["codec"] == "emu3.5"}) == [2, 7, 16, 17]
    assert all(case["differing"] == 0 for case in cases), cases  # the CPU is batch-invariant bit for bit
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "Verdict: batch-invariant on this device for every case" in markdown
    for name in STEPS:
        assert f"## {name}: {report['steps'][name]['status']}" in markdown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md"]


def test_invariance_verdict_names_the_codec_and_the_action():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up there
    spec.loader.exec_module(gpu_check)
    same = {"codec": "emu3.5", "differing": 0}
    assert "batch-invariant on this device" in gpu_check.invariance_verdict({"invariance": [same]})
    flipped = gpu_check.invariance_verdict({"invariance": [same, {"codec": "wavtokenizer", "differing": 3}]})
    assert "NOT batch-invariant" in flipped and "(wavtokenizer)" in flipped and "--fixed-batches" in flipped
    skipped = {"codec": "emu3.5", "status": "skipped: out of time"}
    assert gpu_check.invariance_verdict({"invariance": [same, skipped]}).startswith("Verdict: incomplete")
