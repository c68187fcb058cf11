"""OCR reward from a VLM behind an OpenAI-compatible chat-completions server (vLLM, sglang, ...).

Same request as verl-omni's GRM OCR reward: system "You are a helpful assistant.", user = the image
as a PNG data URL + an instruction to output only the text; the reply is scored with `edit_score`.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
from PIL import Image

from jaxflow_bridge.rewards.base import check_batch
from jaxflow_bridge.rewards.text import edit_score, require_target

log = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful assistant."
USER_PROMPT = ("Please output only the text content from the image without any additional "
               "descriptions or formatting.")
_RETRY_HTTP_CODES = (408, 429)


def png_data_url(image: np.ndarray) -> str:
    """RGB uint8 image -> 'data:image/png;base64,...'."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _is_retryable(err: Exception) -> bool:
    """Transport errors, timeouts, 5xx, 408/429 and malformed replies are retried; other 4xx not."""
    if isinstance(err, urllib.error.HTTPError):
        return err.code >= 500 or err.code in _RETRY_HTTP_CODES
    return True


class VlmOcrReward:
    """`fn(images, prompts) -> (B,) float32`; one request per image, `max_concurrency` in flight."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 temperature: float = 0.7, top_p: float = 0.8, max_tokens: int = 4096,
                 seed: int | None = None, timeout: float = 60.0, max_retries: int = 3,
                 backoff: float = 1.0, max_concurrency: int = 16, check_health: bool = True):
        base = base_url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base
        self.model = model
        self.api_key = api_key
        self.sampling = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        if seed is not None:
            self.sampling["seed"] = seed
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_concurrency = max_concurrency
        if check_health:
            self.health_check()

    def _request(self, path: str, payload: dict | None = None, timeout: float | None = None) -> dict:
        """GET (payload None) or POST JSON to base_url + path; returns the decoded JSON reply."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
            return json.loads(resp.read().decode("utf-8"))

    def health_check(self) -> None:
        """GET /v1/models; RuntimeError naming the URL if unreachable or the model is not served."""
        url = self.base_url + "/v1/models"
        try:
            reply = self._request("/v1/models", timeout=min(self.timeout, 10.0))
        except Exception as err:
            raise RuntimeError(f"VLM OCR server unreachable at {url}: {err}") from err
        served = [m.get("id") for m in reply.get("data", [])]
        if served and self.model not in served:
            raise RuntimeError(f"VLM OCR server at {url} does not serve model {self.model!r}; "
                               f"it serves {served}")

    def _payload(self, image: np.ndarray, text: str) -> dict:
        content = [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                   {"type": "text", "text": text}]
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": content}]
        return {"model": self.model, "messages": messages, **self.sampling}

    def read_text(self, image: np.ndarray, text: str = USER_PROMPT) -> str:
        """The VLM's reply to `text` about one image (by default its transcription), retrying with exponential
        backoff."""
        payload = self._payload(image, text)
        attempt = 0
        while True:
            try:
                reply = self._request("/v1/chat/completions", payload)
                return reply["choices"][0]["message"]["content"] or ""
            except Exception as err:
                if attempt >= self.max_retries or not _is_retryable(err):
                    raise RuntimeError(f"VLM OCR request to {self.base_url} failed after "
                                       f"{attempt + 1} attempt(s): {err}") from err
                delay = self.backoff * 2**attempt
                log.warning("VLM OCR request failed (%s); retrying in %.1fs", err, delay)
                time.sleep(delay)
                attempt += 1

    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        check_batch(images, prompts)
        targets = [require_target(p) for p in prompts]
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(images)))) as ex:
            texts = list(ex.map(self.read_text, images))
        return np.asarray([edit_score(t, g) for t, g in zip(texts, targets)], dtype=np.float32)
