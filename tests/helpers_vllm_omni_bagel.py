"""A stand-in for vLLM-Omni 0.20's BAGEL pipeline over the bagel_torch engine's model (no vLLM-Omni here).

It mirrors what our pipeline calls (vllm_omni/diffusion/models/bagel/: pipeline_bagel.py, bagel_transformer.py), with
their signatures, shapes and packing conventions:
- `NaiveCache`: per layer the packed K/V (tokens, kv_heads, head_dim) of every cached sequence, None while empty;
- `Bagel` (`stock_bagel`): `prepare_prompts` / `forward_cache_update_text` (`[bos] + encode(prompt) + [eos]` at the
  sequence's next positions, a causal prefill appended to the cache), `prepare_start_tokens` / `generate_text`
  (greedy; the fed tokens (seq, 1), start token first, the predicted end token not fed; the cache extended in place),
  `prepare_vae_latent` (`prepare_input`: n images packed, each [<|vision_start|>, h*w latents, <|vision_end|>] after
  its cached context, all at its RoPE position; noise from the global RNG), `prepare_vae_latent_cfg`,
  `_merge_naive_caches`, `_combine_cfg` ("global" renorm over every element of the packed tensor), `forward` (one
  gen-mode LLM forward a step, every branch's sequences packed when `cfg_batched`) and `generate_image` (the
  single-GPU batched-CFG loop: `cfg_batched` from the merged caches, CFG iff lo < t <= hi, `scheduler.step` after
  the combine, else Euler), and the LoRA module tree of `FakeBagel`;
- `BagelPipeline` (`stock_bagel_pipeline`): the text-to-image `forward` (prefill, think, seed, the draw, one
  `generate_image` under autocast, `_decode_image_from_latent`) and the attributes our subclass reads.
By design it differs in three places. A packed LLM forward evaluates each of its varlen sequences alone through
BagelTorch (`prefill`, `extend`, `velocity`: a batch of one, as flash_attn_varlen attends within a sequence), after
checking the packing: a sequence's merged keys are [its cached context rows ; its query rows], its query the two
markers around latents on a row-major grid, every query token at RoPE position = its context length (a violated
layout raises). The timesteps are the contract's float32 sigmas (vLLM-Omni's torch `linspace` may differ by an ulp:
a GPU question). The decode is the engine's. Every LLM forward is logged in `Bagel.llm_forwards` as (mode,
sequences); image CFG and cached contexts before a prefill are not modelled (refused).
"""
from copy import deepcopy
from types import SimpleNamespace

import torch
from PIL import Image

from jaxflow_bridge.contract.schedule import sigma_schedule
from jaxflow_bridge.families.bagel.sampling import PIXELS_PER_TOKEN, SCHEDULER_CONFIG
from jaxflow_bridge.families.bagel.think import think_decode
from jaxflow_bridge.families.bagel.model import BagelContext
from tests.helpers_vllm_omni import FakeBagel


class NaiveCache:
    def __init__(self, num_layers):
        self.key_cache = {i: None for i in range(num_layers)}
        self.value_cache = {i: None for i in range(num_layers)}

    @property
    def num_layers(self):
        return len(self.key_cache)

    @property
    def seq_lens(self):
        return 0 if self.key_cache[0] is None else self.key_cache[0].shape[0]


def _long(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long)


def _int(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int)


def _flat_positions(h: int, w: int, side: int) -> torch.Tensor:
    """`get_flattened_position_ids_extrapolate` on the latent grid: row * side + column, row-major."""
    return (torch.arange(h)[:, None] * side + torch.arange(w)).flatten()


def stock_bagel(engine) -> type:
    """vLLM-Omni's `Bagel` over the bagel_torch `engine`'s model and text head (see the module docstring)."""
    model, ds = engine.model, PIXELS_PER_TOKEN
    empty = model.prefill(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.bool))
    layers = len(model.language_model.model.layers)

    def context(cache: NaiveCache, rows: slice) -> BagelContext:
        """Cached rows of one sequence as a one-row BagelContext."""
        if rows.stop == rows.start:
            return empty
        pick = lambda store: tuple(store[i][rows][None] for i in range(layers))  # noqa: E731
        return BagelContext(pick(cache.key_cache), pick(cache.value_cache),
                            torch.ones(1, rows.stop - rows.start, dtype=torch.bool))

    def store(cache: NaiveCache, contexts: list[BagelContext]) -> None:
        for i in range(layers):
            cache.key_cache[i] = torch.cat([c.keys[i][0] for c in contexts])
            cache.value_cache[i] = torch.cat([c.values[i][0] for c in contexts])

    class Bagel(FakeBagel):
        latent_downsample, max_latent_size = ds, model.max_latent_size

        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(llm_config=SimpleNamespace(num_hidden_layers=layers))
            self.llm_forwards = []

        def prepare_prompts(self, curr_kvlens, curr_rope, prompts, tokenizer, new_token_ids):
            ids, positions, lens, query, past, newlens, new_rope, at = [], [], [], [], [], [], [], 0
            for prompt, kv, rope in zip(prompts, curr_kvlens, curr_rope):
                tokens = [new_token_ids["bos_token_id"], *tokenizer.encode(prompt, add_special_tokens=False),
                          new_token_ids["eos_token_id"]]
                past += range(at, at + kv)
                query += range(at + kv, at + kv + len(tokens))
                at += kv + len(tokens)
                ids += tokens
                positions += range(rope, rope + len(tokens))
                lens.append(len(tokens))
                newlens.append(kv + len(tokens))
                new_rope.append(rope + len(tokens))
            return ({"text_token_lens": _int(lens), "packed_text_ids": _long(ids),
                     "packed_text_position_ids": _long(positions), "packed_text_indexes": _long(query),
                     "packed_key_value_indexes": _long(past), "key_values_lens": _int(curr_kvlens)}, newlens, new_rope)

        def forward_cache_update_text(self, past_key_values, packed_text_ids, packed_text_position_ids,
                                      text_token_lens, packed_text_indexes, packed_key_value_indexes, key_values_lens):
            if past_key_values.seq_lens or int(key_values_lens.sum()):
                raise NotImplementedError("the stand-in prefills empty caches only")
            self.llm_forwards.append(("und", len(text_token_lens)))
            assert torch.equal(packed_text_indexes, torch.arange(len(packed_text_ids)))
            contexts = []
            for ids, pos in zip(packed_text_ids.split(text_token_lens.tolist()),
                                packed_text_position_ids.split(text_token_lens.tolist())):
                assert torch.equal(pos, torch.arange(len(ids)))  # BagelTorch's prefill: token j at position j
                contexts.append(model.prefill(ids[None], torch.ones(1, len(ids), dtype=torch.bool)))
            store(past_key_values, contexts)
            return past_key_values

        def prepare_start_tokens(self, curr_kvlens, curr_rope, new_token_ids):
            return {"packed_start_tokens": _long([new_token_ids["bos_token_id"]] * len(curr_kvlens)),
                    "packed_query_position_ids": _long(curr_rope), "key_values_lens": _int(curr_kvlens),
                    "packed_key_value_indexes": torch.arange(sum(curr_kvlens))}

        def generate_text(self, past_key_values, packed_key_value_indexes, key_values_lens, packed_start_tokens,
                          packed_query_position_ids, max_length, do_sample=False, temperature=1.0, end_token_id=None):
            (kv,) = key_values_lens.tolist()  # the stand-in decodes one sequence
            assert not do_sample and kv == past_key_values.seq_lens == int(packed_query_position_ids[0])
            fed, extended = think_decode(model, engine.head, context(past_key_values, slice(0, kv)),
                                         int(packed_start_tokens[0]), end_token_id, max_length)
            self.llm_forwards += [("und", 1)] * len(fed)
            store(past_key_values, [extended])
            return torch.tensor(fed)[:, None]

        def prepare_vae_latent(self, curr_kvlens, curr_rope, image_sizes, new_token_ids):
            out = {k: [] for k in ("text_ids", "text", "noise", "vae_pos", "vae", "seqlens", "pos", "query", "past")}
            at = q = 0
            for (height, width), kv, rope in zip(image_sizes, curr_kvlens, curr_rope):
                h, w = height // ds, width // ds
                out["past"] += range(at, at + kv)
                out["query"] += range(at + kv, at + kv + h * w + 2)
                out["text_ids"] += [new_token_ids["start_of_image"], new_token_ids["end_of_image"]]
                out["text"] += [q, q + h * w + 1]
                out["vae"] += range(q + 1, q + 1 + h * w)
                out["noise"].append(torch.randn(h * w, self.latent_channel * self.latent_patch_size ** 2))
                out["vae_pos"].append(_flat_positions(h, w, self.max_latent_size))
                out["seqlens"].append(h * w + 2)
                out["pos"] += [rope] * (h * w + 2)
                at, q = at + kv + h * w + 2, q + h * w + 2
            return {"packed_text_ids": _long(out["text_ids"]), "packed_text_indexes": _long(out["text"]),
                    "packed_init_noises": torch.cat(out["noise"]), "packed_vae_position_ids": torch.cat(out["vae_pos"]),
                    "packed_vae_token_indexes": _long(out["vae"]), "packed_seqlens": _int(out["seqlens"]),
                    "packed_position_ids": _long(out["pos"]), "key_values_lens": _int(curr_kvlens),
                    "packed_indexes": _long(out["query"]), "packed_key_value_indexes": _long(out["past"])}

        def prepare_vae_latent_cfg(self, curr_kvlens, curr_rope, image_sizes):
            pos, query, past, at = [], [], [], 0
            for (height, width), kv, rope in zip(image_sizes, curr_kvlens, curr_rope):
                tokens = (height // ds) * (width // ds) + 2
                past += range(at, at + kv)
                query += range(at + kv, at + kv + tokens)
                pos += [rope] * tokens
                at += kv + tokens
            return {"cfg_packed_position_ids": _long(pos), "cfg_key_values_lens": _int(curr_kvlens),
                    "cfg_packed_query_indexes": _long(query), "cfg_packed_key_value_indexes": _long(past)}

        @staticmethod
        def _merge_naive_caches(caches):
            merged = NaiveCache(caches[0].num_layers)
            for i in range(merged.num_layers):
                for src, dst in (("key_cache", merged.key_cache), ("value_cache", merged.value_cache)):
                    parts = [getattr(c, src)[i] for c in caches if getattr(c, src)[i] is not None]
                    dst[i] = torch.cat(parts) if parts else None
            return merged

        @staticmethod
        def _combine_cfg(v_t, cfg_text_v_t, cfg_img_v_t, cfg_text_scale, cfg_img_scale, cfg_renorm_type,
                         cfg_renorm_min):
            if cfg_img_v_t is not None or cfg_renorm_type not in ("global", "channel"):
                raise NotImplementedError("the stand-in combines text CFG with global or channel renorm")
            guided = cfg_text_v_t + cfg_text_scale * (v_t - cfg_text_v_t)
            over = {} if cfg_renorm_type == "global" else {"dim": -1, "keepdim": True}
            return guided * (torch.norm(v_t, **over) / (torch.norm(guided, **over) + 1e-8)).clamp(
                min=cfg_renorm_min, max=1.0)

        def _gen_forward(self, x_t, timestep, vae_row, marker, vae_pos, query_lens, positions, query_indexes, cache,
                         kv_lens, kv_indexes) -> torch.Tensor:
            """One packed gen-mode LLM forward: llm2vae(norm_moe_gen(h)) on every latent query row (0 on markers)."""
            self.llm_forwards.append(("gen", len(query_lens)))
            assert cache.seq_lens == int(kv_lens.sum()) == len(kv_indexes), "cached rows"  # merged[kv_indexes] = cache
            out, sigma = x_t.new_zeros(len(vae_row), x_t.shape[1]), timestep[:1].float()
            q_at = k_at = merged_at = 0
            for q_len, kv in zip(query_lens.tolist(), kv_lens.tolist()):
                rows = slice(q_at, q_at + q_len)
                assert torch.equal(kv_indexes[k_at:k_at + kv], torch.arange(merged_at, merged_at + kv)), "kv layout"
                assert torch.equal(query_indexes[rows], torch.arange(merged_at + kv, merged_at + kv + q_len)), "query"
                lat = vae_row[rows][1:-1]
                assert marker[rows][[0, -1]].tolist() == list(model.markers) and (lat >= 0).all(), "query tokens"
                assert (positions[rows] == kv).all(), "RoPE position"
                grid = (int(vae_pos[lat].max()) // self.max_latent_size + 1,
                        int(vae_pos[lat].max()) % self.max_latent_size + 1)
                assert torch.equal(vae_pos[lat], _flat_positions(*grid, self.max_latent_size)), "latent positions"
                v = model.velocity(x_t[lat][None].float(), sigma, context(cache, slice(k_at, k_at + kv)), grid)
                out[q_at + 1:q_at + q_len - 1] = v[0]
                q_at, k_at, merged_at = q_at + q_len, k_at + kv, merged_at + kv + q_len
            assert q_at == len(vae_row) and k_at == len(kv_indexes)
            return out

        def forward(self, x_t, timestep, packed_vae_token_indexes, packed_vae_position_ids, packed_text_ids,
                    packed_text_indexes, packed_indexes, packed_position_ids, packed_seqlens, key_values_lens,
                    past_key_values, packed_key_value_indexes, cfg_renorm_min=0.0, cfg_renorm_type="global",
                    cfg_text_scale=1.0, cfg_img_scale=1.0, cfg_batched=None):
            assert timestep.unique().shape[0] == 1
            seq_len = int(packed_seqlens.sum())
            vae_row, marker = torch.full((seq_len,), -1), torch.full((seq_len,), -1)
            vae_row[packed_vae_token_indexes] = torch.arange(len(packed_vae_token_indexes))
            marker[packed_text_indexes] = packed_text_ids
            query = (x_t, timestep)
            if cfg_text_scale > 1.0 and cfg_batched is not None:
                b, branches = cfg_batched, cfg_batched["num_branches"]
                rows = self._gen_forward(*query, vae_row.repeat(branches), marker.repeat(branches),
                                         packed_vae_position_ids, b["batched_query_lens"], b["batched_position_ids"],
                                         b["batched_query_indexes"], b["merged_cache"], b["batched_kv_lens"],
                                         b["batched_kv_indexes"])
                v_t, v_text = (rows[k * seq_len:(k + 1) * seq_len][packed_vae_token_indexes] for k in range(2))
            else:
                rows = self._gen_forward(*query, vae_row, marker, packed_vae_position_ids, packed_seqlens,
                                         packed_position_ids, packed_indexes, past_key_values, key_values_lens,
                                         packed_key_value_indexes)
                v_t, v_text = rows[packed_vae_token_indexes], None
            if cfg_text_scale > 1.0:
                v_t = self._combine_cfg(v_t, v_text, None, cfg_text_scale, cfg_img_scale, cfg_renorm_type,
                                        cfg_renorm_min)
            return v_t

        def generate_image(self, packed_text_ids, packed_text_indexes, packed_init_noises, packed_vae_position_ids,
                           packed_vae_token_indexes, packed_seqlens, packed_position_ids, packed_indexes,
                           past_key_values, key_values_lens, packed_key_value_indexes, num_timesteps=24,
                           timestep_shift=1.0, cfg_renorm_min=0.0, cfg_renorm_type="global", cfg_interval=(0, 1),
                           cfg_text_scale=1.0, cfg_text_packed_query_indexes=None, cfg_text_packed_position_ids=None,
                           cfg_text_past_key_values=None, cfg_text_key_values_lens=None,
                           cfg_text_packed_key_value_indexes=None, cfg_img_scale=1.0,
                           cfg_img_packed_query_indexes=None, cfg_img_packed_position_ids=None,
                           cfg_img_past_key_values=None, cfg_img_key_values_lens=None,
                           cfg_img_packed_key_value_indexes=None, return_trajectory_latents=False, scheduler=None,
                           scheduler_kwargs=None):
            if cfg_img_scale > 1.0 or return_trajectory_latents or timestep_shift != SCHEDULER_CONFIG["shift"]:
                raise NotImplementedError("the stand-in runs text CFG, shift 3, no trajectory latents")
            sigmas = torch.from_numpy(sigma_schedule(SCHEDULER_CONFIG, num_timesteps - 1, 1))  # see the docstring
            timesteps, dts, x_t = sigmas[:-1], sigmas[:-1] - sigmas[1:], packed_init_noises
            query = dict(packed_vae_token_indexes=packed_vae_token_indexes, packed_text_ids=packed_text_ids,
                         packed_vae_position_ids=packed_vae_position_ids, packed_text_indexes=packed_text_indexes,
                         packed_indexes=packed_indexes, packed_position_ids=packed_position_ids,
                         packed_seqlens=packed_seqlens, key_values_lens=key_values_lens,
                         past_key_values=past_key_values, packed_key_value_indexes=packed_key_value_indexes)
            cfg_batched = None
            if cfg_text_scale > 1.0:
                seq_len = int(packed_seqlens.sum())
                branches = [(packed_indexes, packed_key_value_indexes, key_values_lens, packed_position_ids),
                            (cfg_text_packed_query_indexes, cfg_text_packed_key_value_indexes,
                             cfg_text_key_values_lens, cfg_text_packed_position_ids)]
                offsets = [0, int(key_values_lens.sum()) + seq_len]  # each branch's [contexts ; queries] merged
                cfg_batched = {
                    "num_branches": 2, "seq_len": seq_len, "batched_query_lens": packed_seqlens.repeat(2),
                    "batched_position_ids": torch.cat([b[3] for b in branches]),
                    "batched_kv_lens": torch.cat([b[2] for b in branches]),
                    "batched_query_indexes": torch.cat([b[0] + o for b, o in zip(branches, offsets)]),
                    "batched_kv_indexes": torch.cat([b[1] + o for b, o in zip(branches, offsets)]),
                    "merged_cache": self._merge_naive_caches([past_key_values, cfg_text_past_key_values])}
            for i, t in enumerate(timesteps):
                guided = cfg_interval[0] < t <= cfg_interval[1]
                v_t = self.forward(x_t, torch.full((x_t.shape[0],), float(t)), **query, cfg_renorm_min=cfg_renorm_min,
                                   cfg_renorm_type=cfg_renorm_type, cfg_text_scale=cfg_text_scale if guided else 1.0,
                                   cfg_batched=cfg_batched)
                if scheduler is not None:
                    x_t = scheduler.step(v_t, timesteps[i], x_t, dts[i], **(scheduler_kwargs or {})).prev_sample
                else:
                    x_t = x_t - v_t * dts[i]
            return x_t.split((packed_seqlens - 2).tolist()), None, None, None

    return Bagel


def stock_bagel_pipeline(engine) -> type:
    """vLLM-Omni's `BagelPipeline` over the bagel_torch `engine` (its `bagel` a `stock_bagel(engine)`)."""
    bagel_cls, tokenizer = stock_bagel(engine), engine.tokenizer
    names = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
    new_token_ids = dict(zip(("bos_token_id", "eos_token_id", "start_of_image", "end_of_image"),
                             tokenizer.convert_tokens_to_ids(list(names))))

    class BagelPipeline:
        def __init__(self, *, od_config):
            self.od_config = SimpleNamespace(**{"dtype": torch.bfloat16, **vars(od_config or SimpleNamespace())})
            self.device, self.bagel, self.vae = torch.device("cpu"), bagel_cls(), engine.decoder
            self.language_model, self.tokenizer = self.bagel.language_model, tokenizer
            self.new_token_ids = new_token_ids
            self.scheduler, self.scheduler_kwargs = None, {}

        @staticmethod
        def _decode_image_from_latent(bagel, vae, latent, image_shape):
            grid = (image_shape[0] // bagel.latent_downsample, image_shape[1] // bagel.latent_downsample)
            return Image.fromarray(engine.loop.decode(latent[None], grid)[0])

        @torch.inference_mode()
        def forward(self, req):
            """Text to image, one prompt, one image; the empty negative prompt; no image CFG branch."""
            sp, extra, bagel = req.sampling_params, req.sampling_params.extra_args or {}, self.bagel
            first = req.prompts[0]
            prompt, shape = first if isinstance(first, str) else first.get("prompt") or "", (sp.height, sp.width)
            assert not extra.get("negative_prompt", "") and extra.get("cfg_img_scale", 1.5) <= 1.0
            gen, cfg_text = ({"kv_lens": [0], "ropes": [0], "past_key_values": NaiveCache(bagel.config.llm_config
                                                                                            .num_hidden_layers)}
                             for _ in range(2))
            inputs, gen["kv_lens"], gen["ropes"] = bagel.prepare_prompts(gen["kv_lens"], gen["ropes"], [prompt],
                                                                         tokenizer, new_token_ids)
            gen["past_key_values"] = bagel.forward_cache_update_text(gen["past_key_values"], **inputs)
            if extra.get("think", False):
                copy = deepcopy(gen)
                tokens = bagel.generate_text(past_key_values=copy["past_key_values"],
                                             max_length=int(extra.get("max_think_tokens", 1000)),
                                             do_sample=bool(extra.get("do_sample", False)),
                                             end_token_id=new_token_ids["eos_token_id"],
                                             **bagel.prepare_start_tokens(gen["kv_lens"], gen["ropes"], new_token_ids))
                gen = {"past_key_values": copy["past_key_values"], "kv_lens": [k + len(tokens) for k in gen["kv_lens"]],
                       "ropes": [r + len(tokens) for r in gen["ropes"]]}
            if sp.seed is not None:
                torch.manual_seed(sp.seed)
            inputs = bagel.prepare_vae_latent(gen["kv_lens"], gen["ropes"], [shape], new_token_ids)
            cfg = bagel.prepare_vae_latent_cfg(cfg_text["kv_lens"], cfg_text["ropes"], [shape])
            with torch.autocast(device_type="cpu", enabled=False, dtype=self.od_config.dtype):
                latents, *_ = bagel.generate_image(
                    past_key_values=gen["past_key_values"], cfg_text_past_key_values=cfg_text["past_key_values"],
                    num_timesteps=int(sp.num_inference_steps or 50), timestep_shift=3.0,
                    cfg_text_scale=extra.get("cfg_text_scale", 4.0), cfg_img_scale=extra.get("cfg_img_scale", 1.5),
                    cfg_interval=extra.get("cfg_interval", (0.4, 1.0)), cfg_renorm_min=extra.get("cfg_renorm_min", 0.0),
                    cfg_renorm_type=extra.get("cfg_renorm_type", "global"), **inputs,
                    cfg_text_packed_position_ids=cfg["cfg_packed_position_ids"],
                    cfg_text_packed_query_indexes=cfg["cfg_packed_query_indexes"],
                    cfg_text_key_values_lens=cfg["cfg_key_values_lens"],
                    cfg_text_packed_key_value_indexes=cfg["cfg_packed_key_value_indexes"],
                    scheduler=self.scheduler, scheduler_kwargs=self.scheduler_kwargs)
            return SimpleNamespace(output=self._decode_image_from_latent(bagel, self.vae, latents[0], shape))

    return BagelPipeline


def stand_in_thinker(engine):
    """vLLM-Omni's thinker stage (`OmniBagelForConditionalGeneration` in vLLM's AR engine) over the bagel_torch
    `engine`'s model: the prompt text tokenized as vLLM does (special tokens in the text become their ids), one causal
    prefill of the und expert at positions 0..L-1, the KV as the DiT stage receives it (per layer packed (L, heads,
    dim) `key_cache` / `value_cache` lists) and the next RoPE position L (`get_kv_transfer_metadata` after a prefill).
    A function text -> (ids, kv, next position)."""
    model, tokenizer = engine.model, engine.tokenizer

    def thinker(text: str):
        ids = tokenizer(text)["input_ids"]
        context = model.prefill(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))
        kv = SimpleNamespace(key_cache=[k[0] for k in context.keys], value_cache=[v[0] for v in context.values])
        return ids, kv, len(ids)

    return thinker
