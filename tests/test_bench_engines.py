"""`omni-mesh bench engines` runs end to end on a tiny checkpoint and its figures add up."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def test_bench_engines_reports_both_sides_in_one_run() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omni_mesh", "bench", "engines", "--duration", "6", "--rounds", "2",
         "--max-tokens", "4", "--max-audio-tokens", "30", "--json"],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    mono, mesh = result["monolithic"], result["mesh"]
    assert mono["rounds"] == 2 and mono["latency_s"] > 0
    assert mesh["errors"] == {}
    # A window of 6 s: a loaded machine (the suite's other worker) must still end a streamed request in it.
    assert mesh["first_audio_s"] is not None and mesh["first_audio_s"] > 0 and mesh["req_per_s_1"] > 0 and mesh["req_per_s_4"] > 0
    assert result["first_audio_vs_monolithic_latency"] == pytest.approx(mesh["first_audio_s"] / mono["latency_s"])
    assert result["req_per_s_4_vs_monolithic"] == pytest.approx(mesh["req_per_s_4"] * mono["latency_s"])


@pytest.mark.timeout(900)  # two meshes of three engines each start and load (minutes on a loaded 2-core host)
def test_bench_engines_clients_compares_batching_with_max_batch_1() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omni_mesh", "bench", "engines", "--clients", "1,2", "--max-batch", "2",
         "--duration", "2", "--max-tokens", "4", "--max-audio-tokens", "10", "--json"],
        capture_output=True, text=True, timeout=840,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["clients"] == [1, 2] and result["max_batch"] == 2
    for side in ("max_batch_1", "max_batch_2"):
        figures = result["sides"][side]
        for clients in ("1", "2"):
            load = figures["clients"][clients]
            assert load["errors"] == {} and load["req_per_s"] > 0 and load["tokens_per_s"] > 0, (side, clients, load)
        assert set(figures["first_audio_s"]) == {"1", "2"}


@pytest.mark.timeout(900)  # two meshes of four engines each start and load (minutes on a loaded 2-core host)
def test_bench_engines_measures_several_inputs_with_and_without_the_encoder_in_one_run() -> None:
    """Issue 38's figures in one run: per kind, first text and first audio with and without the encoder
    stage, the encoder's requests/s, new media against repeated (its cache)."""
    done = subprocess.run(
        [sys.executable, "-m", "omni_mesh", "bench", "engines", "--inputs", "text,image", "--rounds", "1",
         "--max-tokens", "2", "--max-audio-tokens", "5"],
        capture_output=True, text=True, timeout=840,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    blocks = {block.split()[0]: block for block in done.stdout.split("\n\n")[1:]}  # one per kind, in order
    assert list(blocks) == ["text", "image"], done.stdout
    for kind, block in blocks.items():
        rows = {line[:26].strip(): line[26:] for line in block.splitlines()}
        for row in ("time to first text", "time to first audio"):  # new and repeated, with and without the encoder
            assert len(re.findall(r"\d+ ms", rows[row])) == 4, block
        assert re.search(rf"encoder stage: \d+\.\d requests/s with new {kind}, \d+\.\d with repeated", block), block
    assert "the cache on a repeated image, with the encoder stage: first text" in blocks["image"], blocks["image"]


def test_bench_engines_inputs_names_the_kinds_it_takes() -> None:
    done = subprocess.run([sys.executable, "-m", "omni_mesh", "bench", "engines", "--inputs", "image,smell"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--inputs takes kinds from text, audio, image, video" in done.stderr, done.stderr
