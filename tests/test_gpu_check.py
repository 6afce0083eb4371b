"""`make gpu-check`'s script in its tiny CPU mode: every check it makes on a GPU runs here too, so that the one
prepared command a lent GPU gets minutes for cannot rot between the times one is lent."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import ROOT, interpreter, run_environment, run_script


def test_the_gpu_check_runs_every_check_in_its_tiny_mode(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    python, variables = interpreter()  # its train.py runs are forked by the fork server too
    result = run_script([python, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny", "--out", str(out)], 600,
                        run_environment(variables))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {row["check"]: row for row in report["rows"]}
    assert [name for name, row in rows.items() if row["ok"] is False] == []
    expected = ["Llama-3-8B", "losses, fsdp2 against fsdp", "fsdp 32-true", "fsdp2 32-true", "activation checkpointing",
                "resume from the async save", "resume from the synchronous save", "convert_to_hf.py", "--profile_steps",
                "chunked loss / own loss", "GPT-2 ddp bf16-mixed", "T5 ddp bf16-mixed", "supervised, packed, sdpa",
                "fsdp2 --optimizer muon"]
    for part in expected:
        assert any(part in name for name in rows), (part, list(rows))
    assert rows["convert_to_hf.py"]["result"].startswith("logits verified")
    assert report["machine"]["torch"] and report["machine"]["tiny"] is True
    assert "| check | result | expected | |" in result.stdout


def test_the_tiny_mode_judges_as_on_cpu_also_on_a_machine_with_a_gpu(tmp_path: Path, monkeypatch) -> None:
    """Its runs train on CPU, but every verdict asked torch.cuda.is_available(): on a GPU machine (`make test` there)
    the tiny runs' peaks were judged as GPU tensors (69x the plan: FAILED) and the GPU-only rows ran on CPU."""
    import subprocess

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check = gpu_check.Check(gpu_check.TINY, tmp_path, tmp_path / "out.json", tiny=True)
    assert check.on_gpu is False and check.machine["device"].startswith("CPU")
    started = []
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: started.append(kwargs["env"]))
    check.script("train.py")
    assert started[0]["CUDA_VISIBLE_DEVICES"] == ""
