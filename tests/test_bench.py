"""`omni-mesh bench connector` as a user runs it: real processes, small sizes, every figure present."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

BENCH = [sys.executable, "-m", "omni_mesh.cli", "bench", "connector"]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["SharedMemoryConnector", "ZmqConnector"])
def test_the_connector_bench_reports_every_figure(name: str) -> None:
    done = run_bench("--connector", name, "--sizes", "4KiB,64KiB", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["connector"] == name and result["device"] == "cpu"
    assert [r["size"] for r in result["sizes"]] == [4096, 65536]
    for row in result["sizes"]:
        assert row["repeats"] >= 8
        assert 0 < row["put_s"] < row["e2e_s"] and 0 < row["get_s"] < row["e2e_s"]
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0
        assert row["ratio_memcpy"] == pytest.approx(row["gbps"] / row["memcpy_gbps"], rel=1e-6)
        if name == "ZmqConnector":  # raw pyzmq between the same two processes, in the same run
            assert row["raw_gbps"] > 0 and row["ratio_raw"] == pytest.approx(row["gbps"] / row["raw_gbps"], rel=1e-6)
    assert 0 < result["inproc_4k_s"] < 0.01


def test_the_connector_bench_prints_a_table() -> None:
    done = run_bench("--sizes", "4KiB", "--no-raw")
    assert done.returncode == 0, done.stderr
    assert "x memcpy" in done.stdout and "4 KiB" in done.stdout and "in-process 4 KiB put + get" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_the_cuda_bench_without_cuda_is_a_clear_error() -> None:
    done = run_bench("--device", "cuda", "--sizes", "4KiB")
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr


def test_the_yuanrong_bench_starts_its_own_worker() -> None:
    """What `make bench` runs for YuanrongConnector: a throwaway worker, the raw client beside it."""
    done = run_bench("--connector", "YuanrongConnector", "--start-worker", "--sizes", "64KiB", "--json")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["sizes"]
    assert row["gbps"] > 0 and row["raw_gbps"] > 0 and row["ratio_raw"] > 0


def test_start_worker_is_only_for_yuanrong() -> None:
    done = run_bench("--start-worker", "--sizes", "4KiB")
    assert done.returncode == 2 and "YuanrongConnector" in done.stderr
