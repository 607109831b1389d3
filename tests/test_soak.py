"""Short form of benches/soak.py: the OpenAI server on a converted tiny ternary Qwen3, a few clients for a
few seconds with prefix caching on, mid-stream disconnects and bad requests. Every good stream must be
complete (``[DONE]``, usage = ``max_tokens``), every bad request refused with a 4xx, and the server
healthy afterwards, and the prefix cache must have hit. (Memory growth is judged by the long run only: a few seconds say nothing.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("aiohttp")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SOAK = Path(__file__).resolve().parent.parent / "benches" / "soak.py"


def test_short_soak(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(SOAK), "--model", "qwen3", "--duration", "10", "--clients", "4",
           "--bad-share", "0.25", "--disconnect-share", "0.25", "--max-rss-growth", "10",
           "--workdir", str(tmp_path / "work"), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, check=False)
    assert out.exists(), f"soak wrote no summary ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    s = json.loads(out.read_text())
    assert s["errors"] == 0, s["error_samples"]
    assert s["bad_requests_not_4xx"] == 0, s["bad_not_4xx_samples"]
    assert s["healthy_after"] and s["prefix_caching"]
    assert s["by_kind"].get("bad", 0) >= 1 and s["by_kind"].get("completion", 0) + s["by_kind"].get("chat", 0) >= 2
    assert all(400 <= status < 500 for status in s["bad_statuses"])
    # The shared system prompts fill a whole KV block, so prefix caching must actually hit.
    assert s["prefix_cache_tokens"]["hits"] > 0, s["prefix_cache_tokens"]
    assert r.returncode == 0, r.stdout[-3000:]


def _summarize_rss(timeline_mb: list[tuple[float, float]]) -> dict:
    sys.path.insert(0, str(SOAK.parent))
    try:
        import soak
    finally:
        sys.path.remove(str(SOAK.parent))
    rss = [(t, v * 2**20) for t, v in timeline_mb]
    return soak.summarize([], timeline_mb[-1][0], rss, rss[0][1])


@pytest.mark.parametrize("shape", ["plateau", "leak"])
def test_rss_growth_is_judged_on_the_second_half(shape):
    """The hybrid model's measured 20-minute timeline (warm-up to ~780 s, then flat) passes; the same
    start with steady growth afterwards (a leak) fails the default 5 % limit. Growth from 60 s, which
    the first version judged, flags both."""
    warm = [(0, 4119), (60, 5096), (120, 5271), (180, 5317), (300, 5358), (420, 5385), (540, 5416),
            (600, 5435), (720, 5445), (780, 5463)]
    tail = [(840, 5463), (900, 5457), (1020, 5461), (1140, 5460), (1202, 5461)]
    if shape == "leak":
        tail = [(t, 5463 + 1.0 * (t - 780)) for t, _ in tail]  # 60 MiB a minute
    s = _summarize_rss(warm + tail)
    assert s["rss_growth_from_full_load"] > 0.05
    assert (s["rss_growth"] <= 0.05) == (shape == "plateau"), s["rss_growth"]
