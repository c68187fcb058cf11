"""Process 0's side of a step (docs/design.md §2). It alone holds the rollout servers and the reward pool: it
samples the step's prompt groups, generates on the rollout (each chunk scored as it arrives), computes the
advantages and lays out the train batch (`Driver.experience`); it keeps the rollout idle while the learner trains
(`Driver.idle`: asleep with rollout.sleep_while_training), serves each new LoRA to the rollout, and evaluates."""
from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxflow.config import derived
from jaxflow.config import validation as config_lib
from jaxflow.config.machine import cache_root
from jaxflow.config.plan import RunPlan
from jaxflow.config.sections import RunConfig
from jaxflow import families
from jaxflow.trainer import phases
from jaxflow.trainer.divergence import rollout_not_finite
from jaxflow.sync.base_share import torch_base_weights
from jaxflow.run.data import GroupSampler, load_prompts, load_reference
from jaxflow.algorithms import registry
from jaxflow.algorithms.advantages import compute_advantages
from jaxflow.sync.transport import LoRASync, choose_transport
from jaxflow.run.gold import TRAIN_KEY, gold_key
from jaxflow.run.metrics_log import eval_grid_path, image_grid
from jaxflow.trainer.minibatches import compact_zero_advantage, order_minibatches
from jaxflow.run.rollout_client import LocalTransport, RayTransport, RolloutGroup, init_ray
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow_bridge.contract.batch import nonfinite_rows
from jaxflow_bridge.contract.engine_start import EngineStart, slowest_start
from jaxflow_bridge.contract.trajectory import TextLengthError, TrajectoryBatch
from jaxflow_bridge.rewards import RewardPool, build_reward

NOT_SCORES = ("avg", "errors", "seconds", "counts")  # a reward pool result's keys that are no reward's scores


WARMUP_STEPS = 2  # sampling steps of the engines' warm-up request (`Driver.warmup_request`)


def sample_seeds(seed: int, step: int, count: int) -> np.ndarray:
    """Per-sample rollout seeds, a pure function of (seed, step, index): a resumed run draws the same noise."""
    return np.random.default_rng([seed, step]).integers(0, 2 ** 62, size=count)


def text_length_error(err: TextLengthError, cfg: RunConfig) -> config_lib.UserError:
    """The rollout's text longer than the train batch's padding (`config.text_tokens`), as the knob to raise: input
    to fix, one line and exit 2 from the command line."""
    s = cfg.sample
    key = ("negative_max_sequence_length" if err.field.startswith("negative") and s.negative_max_sequence_length
           else "max_sequence_length")
    value, limit = getattr(s, key), f"sample.{key}={err.length}"
    if err.length != value:  # think tokens (they fit max_think_tokens) or an edit prompt's image tokens on top
        extra = "sample.max_think_tokens" if s.think and not err.field.startswith("negative") else "the images' tokens"
        limit = f"{err.length} (sample.{key}={value} + {extra})"
    return config_lib.UserError(f"{err.field} has {err.tokens} tokens > {limit}: raise --config.sample.{key} (or "
                                f"shorten the prompt)")


def sampling(cfg: RunConfig, eval_mode: bool = False) -> dict:
    """The rollout's sampling parameters (`config.sampling`) with `text_tokens`: the engine pads the text it returns
    to the train step's one shape (`config.text_tokens`), once, at its source (it compiles once)."""
    return {**derived.sampling(cfg, eval_mode=eval_mode), "text_tokens": derived.text_tokens(cfg)}


def train_batch(trajectory: TrajectoryBatch, advantages, group_ids, cfg: RunConfig, step: int,
                num_micro_batches: int) -> TrainBatch:
    """The learner's batch of step `step`: the rollout's `trajectory` (prompt group `group_ids` (B,)) with its
    `advantages` and the SDE's noise level, its mini-batches laid out (`order_minibatches`) and with
    train.drop_zero_advantage its zero advantages gathered (`compact_zero_advantage`) into the plan's
    `num_micro_batches` micro-batches of an update."""
    t = cfg.train
    batch = order_minibatches(TrainBatch.of(trajectory, advantages, cfg.sample.noise_level), group_ids,
                              t.num_mini_batches, cfg.seed, step)
    if t.drop_zero_advantage:
        batch = compact_zero_advantage(batch, t.num_mini_batches, num_micro_batches)
    return batch


def merge_rewards(futures: dict) -> dict:
    """The reward pool's results of a step's chunks (`futures`: chunk index -> future) as one batch's: scores
    joined, errors, each reward's scoring seconds and its counts (a VLM judge's refused replies) summed."""
    parts = [futures[c].result() for c in sorted(futures)]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k not in ("errors", "seconds", "counts")}
    out["errors"] = sum(p["errors"] for p in parts)
    out["seconds"] = {k: sum(p["seconds"][k] for p in parts) for k in parts[0]["seconds"]}
    out["counts"] = {}
    for part in parts:
        for name, counts in part.get("counts", {}).items():
            mine = out["counts"].setdefault(name, {})
            for key, value in counts.items():
                mine[key] = mine.get(key, 0) + value
    return out


def count_metrics(prefix: str, counts: dict) -> dict:
    """A reward pool result's counts as metrics `<prefix>/<reward>/<count>` (e.g. reward/vlm_judge/refused)."""
    return {f"{prefix}/{name}/{key}": value for name, mine in counts.items() for key, value in mine.items()}


def edit_conditions(items, references: list | None, n: int) -> tuple:
    """(sources (B,H,W,3) uint8, targets [B]) of the `n` samples of each of `items` (prompt-major, as the rollout
    returns them) for the conditioned rewards: each sample's group reference image (`references`, one
    (1,H,W,3) per item at the sample size; a broadcast view for one group) and target; (None, None) without
    references (no edit data)."""
    if references is None:
        return None, None
    if len(references) == 1:
        sources = np.broadcast_to(references[0], (n, *references[0].shape[1:]))
    else:
        sources = np.repeat(np.concatenate(references), n, axis=0)
    return sources, [it.target for it in items for _ in range(n)]


@dataclasses.dataclass
class Experience:
    """One step's rollout, scored: the train batch (mini-batches laid out) and what it reports."""

    batch: TrainBatch
    rewards: dict  # per reward function, "avg" (their weighted sum), "errors" and "seconds" (scoring, per function)
    zero_std_ratio: float
    policy_version: int  # the policy that sampled it
    versions: int  # distinct policy versions among its samples, as the engines stamped them: 1 (never mixed)

    def metrics(self, bound_modules: int, seconds: float, freed_bytes: int | None = None) -> dict:
        """The metrics logged beside the learner's: rewards, each reward's scoring time (`time/reward_busy/<name>`:
        worker seconds, most of it while the rollout ran; "time/reward" is what the step waited after it), the LoRA's
        bound modules, throughput over the step's wall time `seconds` and the GPU memory a sleeping rollout freed."""
        avg = self.rewards["avg"]
        return {"reward_mean": avg.mean(), "reward_std": avg.std(), "reward_errors": self.rewards["errors"],
                "zero_std_ratio": self.zero_std_ratio, "bound_modules": bound_modules,
                "rollout/versions": self.versions,
                "images_per_s": len(self.batch) / seconds, "time/step": seconds,
                **({"rollout_freed_gib": freed_bytes / 2 ** 30} if freed_bytes is not None else {}),
                **{f"time/reward_busy/{k}": v for k, v in self.rewards["seconds"].items()},
                **{f"reward/{k}": v.mean() for k, v in self.rewards.items() if k not in NOT_SCORES},
                **count_metrics("reward", self.rewards.get("counts", {}))}


class Driver:
    """Built on process 0 with the train `prompts` and the `sampler` that indexes them (its position is checkpointed
    by every process); `launch_rollout`, then `join_rollout` once the trainer's model exists."""

    def __init__(self, cfg: RunConfig, folder: Path, prompts: list, sampler: GroupSampler, plan: RunPlan):
        self.cfg, self.folder, self.prompts, self.sampler, self.plan = cfg, folder, prompts, sampler, plan
        self.test_items = load_prompts(cfg.data.test, config_lib.needs_target(cfg))
        self.spec = derived.lora_spec(cfg)
        try:  # reward models load here (a VLM endpoint's health is checked), before any model or device work
            reward = build_reward(dict(cfg.reward.fns), **cfg.reward.options_dict())
        except FileNotFoundError as exc:  # a reward model's checkpoint folder lacks files: the message names them
            raise config_lib.UserError(str(exc)) from None
        self.pool = RewardPool(reward, cfg.reward.workers)
        # eval.rewards: gold rewards the evals score beside the training rewards (jaxflow/run/gold.py)
        self.gold = RewardPool(build_reward(dict(cfg.eval.rewards), **cfg.reward.options_dict()),
                               cfg.reward.workers) if cfg.eval.rewards else None
        self.rollout = self.lora_sync = None
        self._executor = self._prefetched = None  # rollout.overlap: the thread and (step, future) of a prefetch

    @property
    def loads_apart(self) -> bool:
        """Whether the rollout's engines load in processes of their own (Ray actors: `launch_rollout` returns at
        once), not in this one (rollout.layout='in_process')."""
        return self.cfg.rollout.layout != "in_process"

    def launch_rollout(self) -> None:
        """Start the rollout servers: Ray actors load their engines meanwhile (`loads_apart`), an in-process one
        loads here; `join_rollout` then waits for them."""
        r, in_process = self.cfg.rollout, not self.loads_apart
        if not in_process:
            init_ray(r.address)
        family = families.of(self.cfg)
        engine = {"engine": r.engine, "model": str(self.folder), "dtype": r.dtype, "device": r.device,
                  **family.engine_config(self.cfg)}
        if r.compile:
            engine["compile"] = True
        if r.engine == "vllm_omni" and self.cfg.train.compile_cache:  # torch's compile caches beside JAX's
            engine["compile_cache"] = str(cache_root())
        if r.engine == "vllm_omni":  # the eval's packed requests hold at most a training request's samples
            engine["request_images"] = self.cfg.sample.group_size
        engine["lora_apply"] = self.plan.lora_apply  # layers, merged (jaxflow_bridge/sync/merge.py) or folder
        if self.plan.quantization != "none":  # vllm_omni's FP8 DiT (the validation stage refuses it elsewhere)
            engine["quantization"] = self.plan.quantization
        if self.plan.warmup:
            engine["warmup"] = self.warmup_request()
        if r.share_weights:  # the engine serves the trainer's own arrays (jaxflow/sync/base_share.py)
            engine["base_weights"] = "shared"
        elif self.cfg.model.init == "random":
            engine["random_seed"] = self.cfg.seed  # the rollout draws the same base weights (fingerprint below)
        transport = LocalTransport() if in_process else RayTransport(r.num_cpus, r.num_gpus, r.max_retries)
        self.rollout = RolloutGroup(engine, self.plan.engines, transport)

    def warmup_request(self) -> dict:
        """`RolloutServer`'s warm-up: one rollout call's shape (the first sample.prompts_per_call train prompts x
        sample.group_size, the first step's sampling and seeds), run once and discarded as each engine starts. It
        samples `WARMUP_STEPS` steps (the SDE window the first), not the run's: the model's calls have the same
        shapes at every step, so a short one warms what the first rollout would compile."""
        s = self.cfg.sample
        short = dataclasses.replace(self.cfg, sample=dataclasses.replace(
            s, num_steps=min(s.num_steps, WARMUP_STEPS), window_size=1, window_range=(0, 1)))
        items = self.prompts[:s.prompts_per_call]
        request = {"prompts": [it.prompt for it in items], "n": s.group_size,
                   "sampling": registry.rollout_sampling(sampling(short), short, 0),
                   "seeds": [int(x) for x in sample_seeds(self.cfg.seed, 0, len(items) * s.group_size)]}
        references = self.references(items)
        return request if references is None else {**request, "references": references}

    def join_rollout(self, model, processes: int) -> EngineStart | None:
        """Wait for the launched servers, check that they hold `model`'s base weights (an in-process one is handed
        them with rollout.share_weights) and choose the LoRA sync's transport for `processes` trainer processes.
        Returns where the slowest engine's start went, where its engine reports it (vllm_omni)."""
        r, family, in_process = self.cfg.rollout, families.of(self.cfg), not self.loads_apart
        if r.share_weights:
            self.rollout.share_base_weights(torch_base_weights(model))
        mine = family.fingerprint(model)
        infos = self.rollout.info()
        for info in infos:
            if info["fingerprint"] != mine:
                raise RuntimeError(f"rollout base weights ({info.get('model')}) differ from the trainer's "
                                   f"({self.folder}): fingerprint {info['fingerprint'][:12]} != {mine[:12]}")
        self.lora_sync = LoRASync(self.rollout, self.spec, choose_transport(in_process, processes, infos), infos[0],
                                  verify=self.cfg.train.sync_verify, stale_from=self.cfg.train.sync_fault_from)
        return slowest_start(infos)

    def serve(self, lora, version: int) -> int:
        """The rollout serves `lora` (the train state's whole LoRA) as policy `version`; returns the bound-module
        count (jaxflow/sync/transport.py: the transport chosen at start, failures counted)."""
        return self.lora_sync.serve(lora, version)

    def sync_summary(self, seconds: dict[str, float]) -> str:
        """A sync's parts from its recorded phases `seconds`, for the start-up line (`LoRASync.summary`)."""
        return self.lora_sync.summary(seconds) if self.lora_sync is not None else ""

    @property
    def sync_failures(self) -> int:
        """LoRA syncs that failed so far (each logged)."""
        return self.lora_sync.failures if self.lora_sync is not None else 0

    @property
    def sync_checks(self) -> dict:
        """The last LoRA sync's check: its seconds (`sync_verify_s`) and the mismatches so far (each logged and
        synced again); empty with train.sync_verify off."""
        s = self.lora_sync
        return {} if s is None or s.verify_s is None else {"sync_verify_s": s.verify_s, "sync_mismatches": s.mismatches}

    def _rollout(self, step: int, version: int):
        s = self.cfg.sample
        picks = self.sampler.sample(step)
        items = [self.prompts[picks[i * s.group_size][0]] for i in range(s.prompts_per_step)]
        prompts = [it.prompt for it in items]
        references, per_call, futures = self.references(items), s.prompts_per_call, {}

        def score(c: int, b) -> None:  # chunk c holds the samples of items[c * per_call:][:per_call]
            chunk = slice(c * per_call, (c + 1) * per_call)
            futures[c] = self.pool.submit(b.images, b.prompts, *edit_conditions(
                items[chunk], None if references is None else references[chunk], s.group_size))

        with phases.phase("rollout"):
            try:
                batch = self.rollout.generate(
                    prompts, s.group_size, registry.rollout_sampling(sampling(self.cfg), self.cfg, step),
                    sample_seeds(self.cfg.seed, step, len(picks)), per_call, on_chunk=score, references=references)
            except TextLengthError as err:
                raise text_length_error(err, self.cfg) from None
        if batch.policy_version != version:
            raise RuntimeError(f"rollout served policy {batch.policy_version} for step {step}, expected {version}")
        with phases.phase("reward"):
            rewards = merge_rewards(futures)
        return batch, rewards

    def references(self, items) -> list | None:
        """An edit dataset's reference images of `items` at the sample size (one array per prompt group), or None."""
        if all(it.image is None for it in items):
            return None
        return [load_reference(it.image, self.cfg.sample.height, self.cfg.sample.width) for it in items]

    def experience(self, step: int) -> Experience:
        """Step `step`'s experience: the one `prefetch` started for it (the time waited for it as phase
        "rollout_wait"), or else made now on policy `step`; phases "rollout" and "reward"."""
        if self._prefetched is not None and self._prefetched[0] == step:
            future, self._prefetched = self._prefetched[1], None
            with phases.phase("rollout_wait"):
                experience, theirs = future.result()
            phases.merge(theirs)
            return experience
        return self._experience(step, step)[0]

    def prefetch(self, step: int) -> None:
        """Start step `step`'s experience now, in a thread, on the policy the rollout serves (`step - 1`): it runs
        while the learner trains step `step - 1` (rollout.overlap); the LoRA sync after that step waits for it
        (each actor runs one call at a time), so no rollout mixes policy versions."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-prefetch")
        self._prefetched = (step, self._executor.submit(self._experience, step, step - 1))

    def _experience(self, step: int, version: int) -> tuple[Experience, dict]:
        """The rollout of step `step`'s prompt groups on policy `version`, its rewards and advantages, and the
        train batch (mini-batches laid out); with the phases it recorded (it may run in a thread).
        `RolloutNotFinite` where the rollout of the policy no update has changed yet (version 0) returns float
        arrays that the loss reads with a NaN or an infinity: the engine's output is broken. A later policy's are
        left to the learner, whose non-finite loss skips the update (`divergence.SkipStreak`: it may have
        diverged)."""
        cfg, s = self.cfg, self.cfg.sample
        with phases.recording() as seconds:
            batch, rewards = self._rollout(step, version)
        phases.merge(seconds)
        bad = nonfinite_rows(batch) if version == 0 else None  # host arrays: one pass, no device sync
        if bad:
            raise rollout_not_finite(step + 1, bad, len(batch), cfg.rollout.engine, self.plan.quantization,
                                     self.plan.lora_apply)
        group_ids = np.repeat(np.arange(s.prompts_per_step), s.group_size)
        adv, zero_std = compute_advantages(rewards["avg"], group_ids, global_std=cfg.train.global_std,
                                           clip=cfg.train.adv_clip, expected_group_size=s.group_size)
        versions = len(np.unique(batch.policy_versions))
        batch = train_batch(batch, adv, group_ids, cfg, step, self.plan.num_micro_batches)
        return Experience(batch, rewards, zero_std, version, versions), seconds

    @contextlib.contextmanager
    def idle(self):
        """The rollout idle while the body (the learner's training) runs: its engines asleep, their GPU memory
        freed (rollout.sleep_while_training: phases "sleep" and "wake", woken when the body ends normally), or else
        told that the step's rollouts are over (`RolloutGroup.release_adapter`: an engine with the adapter merged
        into its weights restores its base meanwhile; not while rollout.overlap samples during training). Yields a
        dict that gets "freed_bytes", what sleeping engines freed."""
        slept = {}
        if not self.cfg.rollout.sleep_while_training:
            if not self.cfg.rollout.overlap:
                self.rollout.release_adapter()
            yield slept
            return
        with phases.phase("sleep"):
            slept["freed_bytes"] = self.rollout.sleep()
        yield slept
        with phases.phase("wake"):
            self.rollout.wake()

    def evaluate(self, step: int) -> dict:
        """Mean rewards of ODE samples of the held-out prompts: the training rewards' weighted sum
        (`eval_reward_mean`) and each one's (`eval_reward/<name>`), with eval.rewards each gold reward's
        (`eval_gold/<name>`); their grid goes to run_dir/eval/step_<step>.png. A call holds as many images as a
        training call (`derived.eval_prompts_per_call`): the diffusers engine samples them as one batch; vLLM-Omni
        (one request at a time) packs them into requests of a training request's images (`request_images`)."""
        cfg = self.cfg
        items = self.test_items[:cfg.eval.num_prompts]
        prompts = [it.prompt for it in items]
        references = self.references(items)
        try:
            batch = self.rollout.generate(prompts, 1, sampling(cfg, eval_mode=True), np.arange(len(prompts)),
                                          derived.eval_prompts_per_call(cfg), references=references)
        except TextLengthError as err:
            raise text_length_error(err, cfg) from None
        conditions = edit_conditions(items, references, 1)
        gold = self.gold.submit(batch.images, prompts, *conditions) if self.gold else None
        trained = self.pool.submit(batch.images, prompts, *conditions).result()
        scores = trained["avg"]
        out = {TRAIN_KEY: float(scores.mean()),
               **{f"eval_reward/{k}": float(v.mean()) for k, v in trained.items() if k not in NOT_SCORES},
               **count_metrics("eval_reward", trained["counts"])}
        captions = [f"{r:.2f} {p}" for r, p in zip(scores, prompts)]
        if gold is not None:
            golds = {k: v for k, v in gold.result().items() if k not in NOT_SCORES}
            out.update({gold_key(k): float(v.mean()) for k, v in golds.items()})
            captions = [f"{r:.2f} gold {' '.join(f'{v[i]:.2f}' for v in golds.values())} {p}"
                        for i, (r, p) in enumerate(zip(scores, prompts))]
        image_grid(batch.images, captions, eval_grid_path(cfg.run_dir, step))
        return out

    def close(self) -> None:
        if self._executor is not None:  # a prefetch still running is abandoned with its actors
            self._executor.shutdown(wait=False, cancel_futures=True)
        self.pool.close()
        if self.gold is not None:
            self.gold.close()
        if self.lora_sync is not None:
            self.lora_sync.close()
        if self.rollout is not None:
            self.rollout.close()
