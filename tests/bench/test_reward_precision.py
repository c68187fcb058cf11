"""jaxflow_bench.reward_precision at reward_checkpoints' small sizes on the CPU: HPS's checkpoint is open_clip's
layout, and the benchmark runs end to end, in every dtype, writing its figures."""
import json
import math

import pytest
import torch
from transformers import CLIPModel

from jaxflow_bench import reward_precision as rp
from jaxflow_bridge.rewards.models import hps
from tests.rewards import reward_checkpoints as ckpt


def test_hps_checkpoint_has_open_clips_keys_and_loads_back_exactly():
    torch.manual_seed(0)
    state = CLIPModel(hps.clip_config(ckpt.HPS_ARCH)).state_dict()
    open_clip = rp.clip_to_open_clip(state)
    released = ckpt.open_clip_state(ckpt.HPS_ARCH)
    assert {k: v.shape for k, v in open_clip.items()} == {k: v.shape for k, v in released.items()}
    back = hps.open_clip_to_clip(open_clip)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.slow
def test_tiny_run_scores_in_every_dtype_and_writes_its_figures(tmp_path):
    rp.main(["--size", "tiny", "--device", "cpu", "--pairs", "2", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "reward_precision.json").read_text())
    f = written["figures"]
    assert written["name"] == "reward_precision" and written["size"] == "tiny" and f["pairs"] == 2
    for name in ("pickscore", "hps"):
        for key in ("max_abs_delta_bf16", "max_abs_delta_fp16", "score_spread", "seconds_fp32", "seconds_bf16",
                    "seconds_fp16"):
            assert math.isfinite(f[f"{name}/{key}"]) and f[f"{name}/{key}"] >= 0, (name, key)
        # bfloat16 and float16 really ran: their scores differ from float32's, bfloat16's (8-bit mantissa) the most
        assert f[f"{name}/max_abs_delta_bf16"] > f[f"{name}/max_abs_delta_fp16"] > 0
        assert f[f"{name}/score_spread"] > 0 and f[f"{name}/seconds_fp32"] > 0
