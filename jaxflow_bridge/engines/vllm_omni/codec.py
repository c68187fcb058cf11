"""The rollout's requests and results across vLLM-Omni 0.20: the engine groups a call's prompts into requests
(`request_groups`); our pipelines pack a TrajectoryBatch into vLLM-Omni's DiffusionOutput fields in the worker, the
engine unpacks it from the request's result and pads the call's text to one width (`longest_text`); the engine's
start-up warm-up request (`is_warmup_request`) gets an empty result."""
from __future__ import annotations

import numpy as np
import torch

from jaxflow_bridge.contract.batch import PAYLOAD_FIELDS
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.engines import families
from jaxflow_bridge.rollout.tensors import numpy_to_torch, torch_to_numpy

PAYLOAD_KEY = "rollout"  # our entry in DiffusionOutput.custom_output
# the request id of the warm-up request vLLM-Omni 0.20's engine sends once at start (`DiffusionEngine._dummy_run`)
WARMUP_REQUEST_ID = "dummy_req_id"



def pack_trajectories(batch: TrajectoryBatch) -> dict:
    """DiffusionOutput fields for a batch of one request's samples (one prompt's, or a packed request's prompts').

    trajectory_latents (B, W+1, S, C) and trajectory_log_probs (B, W) use vLLM-Omni's own fields (shared memory
    for large tensors); the schema's other `PAYLOAD_FIELDS` ride in custom_output[PAYLOAD_KEY] as tensors (bf16 embeds
    stay bf16; the text fields the batch carries: embeds or int32 token ids, negatives iff guided, L' = 0
    included). Every tensor is a view of the batch's numpy buffer (no copy); `unpack_trajectories` views them back.
    `output` is the image in [-1, 1] (B, 3, H, W), what vLLM-Omni's diffusers-style post-processing turns into PIL
    images; exact from the uint8 images, so `OmniRequestOutput.images` shows the same pixels.
    """
    payload = {k: getattr(batch, k) for k in PAYLOAD_FIELDS if getattr(batch, k) is not None}
    images = torch.from_numpy(batch.images).permute(0, 3, 1, 2).float() / 127.5 - 1
    return {"output": images, "trajectory_latents": numpy_to_torch(batch.latents),
            "trajectory_log_probs": numpy_to_torch(batch.log_probs),
            "custom_output": {PAYLOAD_KEY: {k: numpy_to_torch(np.ascontiguousarray(v)) for k, v in payload.items()}}}


def is_warmup_request(req) -> bool:
    """Whether a request is vLLM-Omni's start-up warm-up (one prompt, 512 x 512, one step). Our pipelines answer it
    with an empty DiffusionOutput, running neither text encoder, transformer nor VAE: `_dummy_run` only checks the
    result's `error`, and the compile it would warm is redone by the first rollout anyway (LoRA layers are swapped in
    at the first sync, and the rollout's batch is not its batch of one)."""
    return list(getattr(req, "request_ids", None) or ()) == [WARMUP_REQUEST_ID]


def our_pipelines() -> list[str]:
    """The pipeline classes (custom_pipeline_args' pipeline_class) of the families vLLM-Omni serves."""
    return [families.module(name, "vllm_omni_pipeline").PIPELINE_CLASS for name in families.FAMILIES
            if "vllm_omni" in families.spec(name).ENGINES]


def _numpy(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else torch_to_numpy(x)


def unpack_trajectories(output, prompt: str | list[str], group_id: int,
                        thinker_ids: list | None = None) -> TrajectoryBatch:
    """TrajectoryBatch of one request's samples from a vLLM-Omni result (`OmniRequestOutput` or anything with
    trajectory_latents, trajectory_log_probs and custom_output): `prompt`'s samples in group `group_id`, or a packed
    request's prompts' (a list: their samples split evenly, prompt-major, in groups `group_id`, `group_id` + 1, ...);
    ValueError if our payload is missing, if its samples do not split evenly among the prompts, or if `thinker_ids`
    (the ids a two-stage deployment's thinker prefilled) are not every sample's `prompt_ids`."""
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    payload = (getattr(output, "custom_output", None) or {}).get(PAYLOAD_KEY)
    if payload is None or output.trajectory_latents is None:
        raise ValueError(f"vLLM-Omni result for {texts[0][:40]!r} carries no rollout trajectory "
                         f"(error: {getattr(output, 'error', None)!r}); was the pipeline one of {our_pipelines()}?")
    arrays = {k: _numpy(v) for k, v in payload.items()}
    if thinker_ids is not None:
        fed = [list(ids[mask]) for ids, mask in zip(arrays["prompt_ids"], arrays["prompt_mask"])]
        if any(f != [int(t) for t in thinker_ids] for f in fed):
            raise ValueError(f"vLLM-Omni's thinker prefilled {len(thinker_ids)} ids for {texts[0][:40]!r} that are "
                             f"not the trajectory's {len(fed[0])} context ids: the trainer would rebuild another context")
    latents = _numpy(output.trajectory_latents)
    per, rest = divmod(len(latents), len(texts))
    if rest or not per:
        raise ValueError(f"vLLM-Omni returned {len(latents)} samples for a request of {len(texts)} prompts: not the "
                         f"same number for each")
    return TrajectoryBatch.from_dict({  # the trajectory crossed from the worker: validated here, once
        **arrays, "latents": latents, "log_probs": _numpy(output.trajectory_log_probs),
        "prompts": np.asarray(np.repeat(texts, per), np.str_),
        "group_ids": group_id + np.repeat(np.arange(len(texts), dtype=np.int64), per)})


def request_groups(prompts: int, n: int, packs: bool, limit: int | None) -> list[range]:
    """The prompts of each request, consecutive: with one sample per prompt (n == 1) and a kind that packs, up to
    `limit` prompts a request (all without one); otherwise one prompt a request."""
    size = (limit or prompts) if n == 1 and packs else 1
    return [range(i, min(i + size, prompts)) for i in range(0, prompts, size)]


def longest_text(parts) -> tuple[int, int]:
    """The longest prompt and negative prompt (0 without CFG) over a call's trajectories."""
    def width(b, prefix):
        mask = getattr(b, f"{prefix}_mask")
        return 0 if mask is None else mask.shape[1]
    return tuple(max(width(b, prefix) for b in parts) for prefix in ("prompt", "negative_prompt"))
