"""One device choice, made once (shoal/device.py): what `auto` picks, what a missing device prints, the
precision each setting gives, and the wire staying device-free.

Run: .venv/bin/python -m pytest tests/test_device.py -q
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shoal
from shoal.config import ConfigError
from shoal.device import DeviceError, autocast, autocast_dtype, check_device_spec, choose_device, describe, to_host
from shoal.node.config import LimitOptions

NO_CUDA = not torch.cuda.is_available()
SHOAL_DIR = Path(shoal.__file__).parent


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA: auto takes it")
def test_auto_falls_back_to_the_cpu_and_says_so_in_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="shoal.device"):
        device = choose_device("auto")
    if device.type == "mps":
        pytest.skip("this machine has MPS: auto takes it")
    assert device == torch.device("cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "shoal.device"]
    assert lines == ["no CUDA or MPS device found: computing on the CPU"]


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_a_device_this_machine_lacks_is_refused_in_one_line():
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError, match=f"--device {spec}: this machine has no CUDA device"):
            choose_device(spec)


def test_a_device_spec_is_checked_before_anything_starts():
    for good in ("auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"):
        assert check_device_spec(good) is None
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "tpu", ""):
        assert "must be auto, cpu, cuda, cuda:N or mps" in (check_device_spec(bad) or "")
        with pytest.raises(ConfigError, match="--device"):
            LimitOptions(device=bad)
    with pytest.raises(ConfigError, match="--memory-limit"):
        LimitOptions(memory_limit_gib=0)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("command", [["node", "--device", "cuda"], ["train", "--local", "--device", "cuda"]])
def test_cli_without_cuda_exits_2_with_one_line(command, tmp_path):
    result = subprocess.run([sys.executable, "-m", "shoal.cli", *command, "--report", str(tmp_path / "r")]
                            if command[0] == "train" else [sys.executable, "-m", "shoal.cli", *command],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda: this machine has no CUDA device" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_precision_follows_the_setting_and_the_device():
    cpu = torch.device("cpu")
    assert autocast_dtype(cpu, "auto") is None  # CPUs keep float32: bf16 is slower there, and inexact
    assert autocast_dtype(cpu, "float32") is None
    assert autocast_dtype(cpu, "bfloat16") is torch.bfloat16
    layer = torch.nn.Linear(8, 8)
    with autocast(cpu, torch.bfloat16):
        assert layer(torch.ones(2, 8)).dtype == torch.bfloat16
    with autocast(cpu, None):
        assert layer(torch.ones(2, 8)).dtype == torch.float32


def test_describe_reports_memory_and_to_host_is_free_on_the_host():
    info = describe(torch.device("cpu"))
    assert info.kind == "cpu" and info.name and 0 < info.free_bytes <= info.total_bytes
    x = torch.ones(3)
    assert to_host(x).data_ptr() == x.data_ptr()


def test_no_module_but_the_device_module_names_a_backend():
    """One place decides: `cuda` and `mps` appear only in shoal/device.py, in code, help or docstrings."""
    offenders = []
    for path in SHOAL_DIR.rglob("*.py"):
        if path == SHOAL_DIR / "device.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(cuda|mps|is_cuda)\b", line, re.IGNORECASE):
                offenders.append(f"{path.relative_to(SHOAL_DIR)}:{number}")
    assert not offenders, offenders
