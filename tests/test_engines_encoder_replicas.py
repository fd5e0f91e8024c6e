"""The encoder stage scales like any stage: `replicas: 2` on it, both replicas serve, each with its own
cache, and every reply is the one a single encoder gives (the thinker's text, greedy)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from support.media_engines import require_media_engines

require_media_engines()

from support import media_files  # noqa: E402
from support.meshkit import running_mesh, wait_for  # noqa: E402

from omni_mesh.engines.tiny import build_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = 6


def text_of(outputs: list[dict]) -> str:
    return "".join(chunk.get("text") or "" for chunk in outputs)


def test_two_encoder_replicas_share_the_work(tmp_path: Path) -> None:
    checkpoint = build_tiny("qwen2_5_omni", tmp_path / "tiny")
    # compose/qwen2_5_omni.yaml's encoder and thinker, the encoder with two replicas; the thinker's text is the reply
    spec = yaml.safe_load((ROOT / "compose" / "qwen2_5_omni.yaml").read_text())
    spec["stages"] = [stage for stage in spec["stages"] if stage["name"] in ("encoder", "thinker")]
    spec["stages"][0]["replicas"] = 2
    spec["stages"][1]["final_output"] = True
    del spec["openai"]
    images = [media_files.image("png", 32 + 4 * (n % 3), 24, color=(40 * (n % 3), 200, 7)) for n in range(REQUESTS)]
    params = {"temperature": 0, "max_tokens": 3}

    def ask(pixels: bytes) -> str:
        content = [media_files.image_url(pixels), {"type": "text", "text": "What is this?"}]
        return text_of(mesh.ok({"messages": [{"role": "user", "content": content}]}, params=params, timeout_s=120)["outputs"])

    with running_mesh(tmp_path / "mesh", spec, env={"OMNI_MESH_MODEL": str(checkpoint)}) as mesh:
        def both_encoders() -> list[dict] | None:  # /ready needs one healthy replica a stage, not every one
            encoders = mesh.stages()["encoder"]
            return encoders if len(encoders) == 2 and {r["health"] for r in encoders} == {"healthy"} else None

        wait_for(both_encoders, 120, "both encoder replicas registered and healthy")
        alone = [ask(pixels) for pixels in images[:3]]  # three different images, one at a time
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(ask, images))  # the same three again, twice each, at once
        assert together == alone + alone

        def counted() -> list[dict] | None:
            replicas = mesh.stages()["encoder"]
            done = sum(r["counters"].get("encoder_cache_hits_total", 0) + r["counters"].get("encoder_cache_misses_total", 0)
                       for r in replicas)
            return replicas if done == 3 + REQUESTS else None

        replicas = wait_for(counted, 10, "every encoding counted in the replicas' heartbeats")
    assert all(r["processed"] >= 1 for r in replicas), [r["processed"] for r in replicas]
    assert sum(r["processed"] for r in replicas) == 3 + REQUESTS
    # each replica has its own cache: an image is encoded at most once per replica
    assert sum(r["counters"]["encoder_cache_misses_total"] for r in replicas) <= 2 * 3
