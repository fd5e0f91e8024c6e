"""`omni-mesh bench thinker`: the thinker stage alone against `transformers serve --continuous-batching`
on the same weights, run small end to end (2 clients, one short round), so it cannot rot; and the causal
twin it serves is the thinker's language model (greedy ids equal) and is refused for other checkpoints."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers serve needs it on a CPU (pyproject's bench extra)

from omni_mesh.bench.causal_twin import build_twin, same_greedy_ids  # noqa: E402
from omni_mesh.engines.tiny import build_tiny  # noqa: E402


@pytest.mark.timeout(600)  # two servers start and load (a minute or more on a loaded 2-core host)
def test_bench_thinker_measures_both_servers_in_one_run() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omni_mesh", "bench", "thinker", "--clients", "2", "--rounds", "1", "--duration", "2",
         "--max-tokens", "8", "--cb-num-blocks", "16", "--json"],
        capture_output=True, text=True, timeout=560,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["greedy_ids_equal"] and result["reply_tokens"] >= 1
    assert result["kv_cache_tokens"] == 16 * result["cb_block_size"]  # the same KV budget on both sides
    for side in ("mesh", "transformers"):
        figures = result["sides"][side]["2"]
        assert figures["errors"] == {}, (side, figures)
        assert figures["req_per_s"] > 0 and figures["tokens_per_s"] > 0, (side, figures)
        # every reply is the greedy one: its usage counts the same tokens on both sides
        assert figures["tokens_per_s"] == pytest.approx(figures["req_per_s"] * result["reply_tokens"])
        assert 0 < figures["first_token_p50_s"] <= figures["p50_s"] <= figures["p99_s"]
    ratios = result["ratios"]["2"]
    mesh, serve = result["sides"]["mesh"]["2"], result["sides"]["transformers"]["2"]
    assert ratios["tokens_per_s"] == pytest.approx(mesh["tokens_per_s"] / serve["tokens_per_s"])
    assert ratios["p99"] == pytest.approx(mesh["p99_s"] / serve["p99_s"])
    assert all(not math.isnan(load) for load in result["load_average"])


def test_the_causal_twin_gives_the_thinkers_greedy_ids(tmp_path: Path) -> None:
    checkpoint = build_tiny("qwen2_5_omni", tmp_path / "tiny")
    twin = build_twin(checkpoint, tmp_path / "twin")
    config = json.loads((twin / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert "processor_class" not in json.loads((twin / "tokenizer_config.json").read_text())
    check = same_greedy_ids(checkpoint, twin, "what is the weather like today", 12)
    assert check["equal"] and len(check["thinker"]) >= 1, check


def test_the_causal_twin_is_refused_for_a_checkpoint_that_is_not_qwen2_5_omni(tmp_path: Path) -> None:
    checkpoint = build_tiny("qwen3_omni", tmp_path / "tiny")
    with pytest.raises(ValueError, match="not a Qwen2.5-Omni checkpoint"):
        build_twin(checkpoint, tmp_path / "twin")
