"""BAGEL's think mode on `BagelTorch` (docs/bagel.md §2, item 3): a greedy text decode by the understanding expert
that extends the conditional context before the image is drawn.

As vLLM-Omni 0.20's `Bagel.generate_text` after `prepare_start_tokens`: feed `<|im_start|>` at the context's next
RoPE position, then repeatedly take the argmax of lm_head(norm(h)) of the last fed token and feed it; stop right
after *predicting* `<|im_end|>` (never fed) or once `max_tokens` tokens are fed (the last prediction dropped). The
fed tokens, start token included, extend the context's K/V and positions, and follow the prompt's ids in the
trajectory's `prompt_ids`, from which the trainer's prefill rebuilds the same context. The head's tensors
(`language_model.model.norm`, `language_model.lm_head`) are among those the trainer ignores
(`bagel_keymap.IGNORED_PREFIXES`): `BagelTorch`'s weights, fingerprint and LoRA do not see them. Never imports JAX.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from jaxflow_bridge.families.bagel.model import BagelContext, BagelTorch, RMSNorm


class TextHead(nn.Module):
    """The understanding expert's text logits lm_head(norm(h)), under the checkpoint's names."""

    def __init__(self, hidden_size: int, vocab_size: int, rms_norm_eps: float):
        super().__init__()
        self.language_model = nn.Module()
        self.language_model.model = nn.Module()
        self.language_model.model.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.language_model.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy its two tensors in from checkpoint tensors; ValueError naming a missing one."""
        missing = sorted(set(self.state_dict()) - set(tensors))
        if missing:
            raise ValueError(f"think mode needs the checkpoint's text head: missing {missing}")
        self.load_state_dict({k: tensors[k].to(torch.float32) for k in self.state_dict()})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.language_model.lm_head(self.language_model.model.norm(h))


@torch.inference_mode()
def think_decode(model: BagelTorch, head: TextHead, context: BagelContext, start_id: int, end_id: int,
                 max_tokens: int) -> tuple[list[int], BagelContext]:
    """The greedy decode from one unpadded context: (the fed tokens, the context extended by them)."""
    fed, token = [], start_id
    while len(fed) < max_tokens:
        fed.append(token)
        h, context = model.extend(torch.tensor([token]), context)
        token = int(head(h)[0].argmax())
        if token == end_id:
            break
    return fed, context


class Thinker:
    """Think decodes of prompts on `model` with `head`; `start_id` / `end_id`: the tokenizer's `<|im_start|>` and
    `<|im_end|>`."""

    def __init__(self, model: BagelTorch, head: TextHead, start_id: int, end_id: int):
        self.model, self.head, self.start_id, self.end_id = model, head, start_id, end_id

    def __call__(self, ids: Sequence[int], max_tokens: int) -> tuple[list[int], BagelContext]:
        """A prompt's context ids (framing included) prefilled, then `think_decode`: (fed tokens, one-row context)."""
        ids = torch.tensor([list(ids)])
        context = self.model.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
        return think_decode(self.model, self.head, context, self.start_id, self.end_id, max_tokens)
