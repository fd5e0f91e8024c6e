"""`omni-mesh bench connector` and `bench pipeline` as a user runs them: real processes, small sizes
and short rounds, every figure present."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_mesh.bench import pipeline
from omni_mesh.bench.mesh import running_mesh

BENCH = [sys.executable, "-m", "omni_mesh.cli", "bench", "connector"]
PIPELINE = [sys.executable, "-m", "omni_mesh.cli", "bench", "pipeline"]
NOOP = str(Path(__file__).parents[1] / "compose" / "noop-pipeline.yaml")


def run_bench(*args: str, bench: list[str] = BENCH) -> subprocess.CompletedProcess:
    return subprocess.run([*bench, *args], capture_output=True, text=True, timeout=300)


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


@pytest.mark.parametrize("name", ["SharedMemoryConnector", "ZmqConnector"])
def test_the_zero_copy_bench_puts_connector_empty_outputs(name: str) -> None:
    """--zero-copy puts tensors from connector.empty(): the put is the bookkeeping alone, reported
    against a memcpy of the same bytes, with the pool's growth and fallbacks (none here)."""
    done = run_bench("--connector", name, "--sizes", "1MiB", "--zero-copy", "--no-raw", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["zero_copy"] is True and result["config"] == {}  # the connector's default config
    (row,) = result["sizes"]
    # The ratio is the put against a memcpy of the same bytes, both from this run (that the put copies
    # nothing is tested in test_zero_copy_outputs by counters: no timing bound here, on a loaded machine).
    memcpy_s = row["size"] / (row["memcpy_gbps"] * 1e9)
    assert row["put_ratio_memcpy"] == pytest.approx(row["put_s"] / memcpy_s, rel=1e-6), row
    assert row["pool_grown"] == 0 and row["fallbacks"] == 0 and row["fallbacks_after_first"] == 0, row


def test_the_connector_bench_prints_a_table() -> None:
    done = run_bench("--sizes", "4KiB", "--no-raw")
    assert done.returncode == 0, done.stderr
    assert "x memcpy" in done.stdout and "4 KiB" in done.stdout and "in-process 4 KiB put + get" in done.stdout


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_the_handoff_bench_reports_the_median_and_the_ratio_to_the_same_run_limit(zero_copy: bool) -> None:
    """--handoff: steady-state 1 MiB hand-offs (put, get, release, answer) against one memcpy plus an
    empty round trip between the same two processes, measured in the same run."""
    flags = ["--zero-copy"] if zero_copy else []
    done = run_bench("--handoff", "--handoffs", "60", *flags, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["size"] == 1 << 20 and result["handoffs"] == 60 and result["zero_copy"] is zero_copy
    assert 0 < result["put_s"] < result["handoff_s"] and 0 < result["get_release_s"] < result["handoff_s"]
    assert result["memcpy_s"] > 0 and result["round_trip_s"] > 0
    assert result["limit_s"] == pytest.approx(result["memcpy_s"] + result["round_trip_s"], rel=1e-9)
    assert result["ratio_limit"] == pytest.approx(result["handoff_s"] / result["limit_s"], rel=1e-9)
    assert result["ratio_in_sequence"] == pytest.approx(result["handoff_s"] / result["in_sequence_s"], rel=1e-9)
    assert result["pool_grown"] == 0 and result["fallbacks"] == 0, result
    table = run_bench("--handoff", "--handoffs", "12", "--sizes", "64KiB")
    assert table.returncode == 0, table.stderr
    assert "64 KiB hand-off" in table.stdout and "x the limit" in table.stdout and "in sequence" in table.stdout


def test_the_handoff_bench_takes_one_size() -> None:
    done = run_bench("--handoff", "--sizes", "1MiB,2MiB")
    assert done.returncode != 0 and "--handoff takes one size" in done.stderr, done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_the_cuda_bench_without_cuda_is_a_clear_error() -> None:
    done = run_bench("--device", "cuda", "--sizes", "4KiB")
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr


def test_the_yuanrong_bench_starts_its_own_worker() -> None:
    """What `make bench` runs for YuanrongConnector: a throwaway worker, the raw client beside it. The
    worker's RPCs get 30 s, not the default 3 s: on a loaded 2-core machine one put took longer once,
    and this test is about the run, not the latency."""
    config = json.dumps({"req_timeout_ms": 30000})
    done = run_bench(
        "--connector", "YuanrongConnector", "--start-worker", "--config", config, "--sizes", "64KiB", "--json"
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["sizes"]
    assert row["gbps"] > 0 and row["raw_gbps"] > 0 and row["ratio_raw"] > 0


def test_start_worker_is_only_for_yuanrong() -> None:
    done = run_bench("--start-worker", "--sizes", "4KiB")
    assert done.returncode == 2 and "YuanrongConnector" in done.stderr


# ---------------------------------------------------------------------- bench pipeline


def test_the_pipeline_bench_measures_curve_on_and_off_in_one_run() -> None:
    """What `make bench` runs, in short rounds: CURVE on and off alternate, each on a fresh mesh, and
    each round confirms from the coordinator's log which control plane it measured."""
    done = run_bench("--topology", NOOP, "--concurrency", "4", "--duration", "1", "--rounds", "2", "--json",
                     bench=PIPELINE)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["security"] == "both" and result["topology"] == NOOP
    assert [(r["mode"], r["control_plane"]) for r in result["rounds"]] == [
        ("on", "CURVE"), ("off", "insecure"), ("on", "CURVE"), ("off", "insecure")
    ]
    for r in result["rounds"]:
        assert r["ok"] > 0 and r["errors"] == {} and r["req_per_s"] == pytest.approx(r["ok"] / r["duration_s"])
        assert 0 < r["p50_s"] <= r["p99_s"]
        assert r["mesh_cpu_s"] > 0 and r["cpu_s_per_request"] == pytest.approx(r["mesh_cpu_s"] / r["ok"])
        assert set(r["stages"]) == {"first", "second", "third"}
    for mode in ("on", "off"):
        summary = result["modes"][mode]
        rates = [r["req_per_s"] for r in result["rounds"] if r["mode"] == mode]
        assert summary["rounds"] == 2 and summary["req_per_s_rounds"] == rates
        assert summary["req_per_s"] == pytest.approx(sum(rates) / 2)  # the median of two
    ratio = result["ratio_on_off"]
    assert ratio["req_per_s"] == pytest.approx(result["modes"]["on"]["req_per_s"] / result["modes"]["off"]["req_per_s"])
    assert len(ratio["req_per_s_pairs"]) == 2 and all(x > 0 for x in ratio["req_per_s_pairs"])
    assert ratio["cpu_s_per_request"] == pytest.approx(
        result["modes"]["on"]["cpu_s_per_request"] / result["modes"]["off"]["cpu_s_per_request"]
    )
    text = pipeline.report(result)  # the table, from the same figures
    assert "median CURVE on" in text and "median CURVE off" in text
    assert f"CURVE on / off: throughput {ratio['req_per_s']:.3f}x" in text
    assert text.count("round  CURVE") == 4 and "third" in text


def test_the_pipeline_bench_compares_coordinator_counts_in_one_run() -> None:
    """`--coordinators 1,2`: rounds alternate over `up --coordinators N`, each count's medians and the
    ratio of the last to the first (issue 42)."""
    done = run_bench("--topology", NOOP, "--concurrency", "4", "--duration", "1", "--rounds", "1",
                     "--coordinators", "1,2", "--json", bench=PIPELINE)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert [r["mode"] for r in result["rounds"]] == ["coordinators=1", "coordinators=2"]
    for r in result["rounds"]:
        assert r["ok"] > 0 and r["errors"] == {} and 0 < r["p50_s"] <= r["p99_s"]
    one, two = result["modes"]["coordinators=1"], result["modes"]["coordinators=2"]
    ratio = result["ratio_coordinators"]
    assert ratio["req_per_s"] == pytest.approx(two["req_per_s"] / one["req_per_s"])
    assert ratio["p99_s"] == pytest.approx(two["p99_s"] / one["p99_s"])
    text = pipeline.report(result)
    assert "median coord. 1" in text and "median coord. 2" in text and "2 / 1 coordinators: throughput" in text
    refused = run_bench("--topology", NOOP, "--coordinators", "0,2", bench=PIPELINE)
    assert refused.returncode == 2 and "--coordinators" in refused.stderr


def test_the_pipeline_bench_measures_a_running_mesh_as_it_runs() -> None:
    with running_mesh(NOOP) as mesh:
        done = run_bench("--url", mesh.url, "--concurrency", "2", "--duration", "1", bench=PIPELINE)
        refused = run_bench("--url", mesh.url, "--security", "off", bench=PIPELINE)
    assert done.returncode == 0, done.stderr
    assert "median as running" in done.stdout and "CURVE on / off" not in done.stdout
    assert "mesh CPU    -" in done.stdout  # another machine's processes, perhaps: not counted
    assert refused.returncode == 2 and "--security" in refused.stderr and "--topology" in refused.stderr


def test_the_pipeline_bench_reports_time_to_first_audio_when_streaming() -> None:
    demo = Path(__file__).resolve().parents[1] / "compose" / "omni-demo.yaml"
    with running_mesh(str(demo)) as mesh:
        done = run_bench(
            "--url", mesh.url, "--stream", "--concurrency", "2", "--duration", "3",
            "--params", '{"decode_delay_s": 0.01}', "--json", bench=PIPELINE,
        )
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)["modes"]["running"]
    assert figures["ok"] > 0 and not figures["errors"]
    # Text first, audio well before the end: the demo streams for real.
    assert figures["first_chunk_p50_s"] <= figures["first_audio_p50_s"] < 0.8 * figures["p50_s"], figures


def test_a_streamed_reply_that_outlasts_the_window_still_counts_its_first_audio() -> None:
    """Under load a streamed reply may end after the measured window while its first audio came inside
    it: time to first audio is what the user felt then, so it counts (and the reply's latency does not)."""
    demo = Path(__file__).resolve().parents[1] / "compose" / "omni-demo.yaml"
    # 16 reply tokens in chunks of 4, 0.3 s a token (the talker's sleeps: never faster): first audio
    # after >= 1.2 s, inside the 2 s window that opens WARMUP_S (1 s) after the first request starts;
    # the whole reply after >= 4.8 s, after the window closes at 3 s.
    params = {"max_tokens": 16, "chunk_tokens": 4, "decode_delay_s": 0.3}
    body = {"inputs": {"prompt": " ".join(["word"] * 16)}, "params": params, "timeout_s": 30.0, "stream": True}
    assert pipeline.WARMUP_S == 1.0
    with running_mesh(str(demo)) as mesh:
        figures = asyncio.run(pipeline.drive(mesh.url, 1, 2.0, body))
    assert figures["ok"] == 0, figures  # no reply ended inside the window
    assert 1.2 <= figures["first_audio_p50_s"] <= 3.0, figures
