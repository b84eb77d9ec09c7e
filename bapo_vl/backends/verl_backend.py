"""verl 0.9.1 backend: the backend interface of bapo_vl.trainer.Trainer on top of verl's workers.

The BAPO rules are NOT reimplemented here: `bapo_vl.trainer.Trainer` drives this object exactly as it drives the
embedded backend (sync / encode / generate / decode / update / state_dict). What this module does:

  generate  our encoded prompts -> a verl DataProto of dataset rows (`raw_prompt` with PIL images, data_source,
            reward_model, extra_info, uid, ...), repeated n times (interleaved), padded to the rollout manager's
            divisor (`rollout.agent.num_workers`) -> `rollout_manager.generate_sequences` -> per prompt a list of
            (response token ids, behaviour log-probs from `rollout_log_probs`).
  update    UpdateBatch -> a DataProto with input_ids / attention_mask / position_ids / responses / response_mask /
            old_log_probs (= the STORED behaviour log-probs, right-padded) / advantages (token level) [/ ref_log_prob,
            rollout_is_weights] -> `actor.update_actor`; rows by length within each rank's mini-batch.
  sync      `checkpoint_manager.update_weights()`: alpha <- pi_theta, only when the Trainer asks (t % v == 0).
  metrics   verl's actor metric names -> the record's (VERL_METRICS), verl's own names kept beside them.
  profile   verl's `global_profiler` (tool, steps, save_path) with the actor's `profiler.enable`: the actor's passes
            of those steps run under verl's profiler, as in verl's fit().

Delayed rollout policy: the rollout engine keeps its weights between syncs only if it never
sleeps at level 2, i.e. `actor_rollout_ref.rollout.free_cache_engine=False` for colocated vLLM (the engine's memory
stays resident). `validate_verl_config` refuses the other combinations (free_cache_engine=True with vLLM discards the
weights on sleep; SGLang raises) instead of training on garbage weights. With v = 1 and free_cache_engine=True the
engine sleeps before each update (`checkpoint_manager.sleep_replicas()`, as verl's fit() does) so that the actor's
passes get its memory, and the next weight push wakes it.

Re-evaluation with the current policy (X2, policy="current"): the engine is temporarily synced to pi_theta, then the
stale alpha is put back. alpha is kept as a CPU snapshot of the actor shards taken at each sync
(`save_model_to_cpu`, verl's experimental `DetachActorWorker`); putting it back is
save current -> restore alpha -> update_weights -> restore current. Cost per re-evaluation: two weight pushes to
the engine and two CPU copies of the actor shards (the authors' code also forces a temporary sync).

Batch trimming (`trainable_groups`): verl splits the update batch across the data-parallel ranks and each rank's
share into micro-batches of `ppo_micro_batch_size_per_gpu` sequences (it asserts whole ones), in mini-batches of
`mini_batch_size` prompts. BAPO batches vary in size, so the last groups of the batch (X3 first, then X2: the batch
is X1 + X2 + X3) are dropped so that
  n_groups >= mini:  n_groups -> floor(n_groups / mini) * mini           (full mini-batches only)
  n_groups <  mini:  the largest k <= n_groups with k * G % (dp * micro) == 0   (one smaller optimizer step)
and the number dropped is reported as `trimmed_groups`.
"""
from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from collections import Counter
from types import SimpleNamespace

import numpy as np
import torch

from bapo_vl.backends.base import (UPDATE_METRICS, Policy, Response, UpdateBatch, UpdateResult, old_logprobs, pack,
                                   right_pad)
from bapo_vl.backends.gpu_memory import named
from bapo_vl.backends.verl_data import problem_to_row
from bapo_vl.problem import Problem

log = logging.getLogger(__name__)

ROW_KEYS = ("raw_prompt", "data_source", "reward_model", "extra_info", "index", "tools_kwargs",
            "interaction_kwargs", "uid")
ALPHA, CURRENT = "bapo_alpha", "bapo_current"  # keys of the CPU snapshots in the actor workers
BOOKKEEPING = "verl_backend.json"  # in a checkpoint folder: alpha_stale, step, calls
# The record's names (base.UPDATE_METRICS) <- the names verl's actor returns them under (RayPPOTrainer._update_actor
# prefixes the worker's metrics with actor/; our balanced_clip plugin reports actor/clip_frac). First present wins.
VERL_METRICS = {
    "loss": ("actor/loss",),
    "pg_loss": ("actor/pg_loss",),
    "kl": ("actor/kl_loss",),
    "entropy": ("actor/entropy_loss", "actor/entropy"),
    "clip_frac": ("actor/pg_clipfrac", "actor/clip_frac"),
    "grad_norm": ("actor/grad_norm",),
    "lr": ("actor/lr", "lr"),
}
COUNTED = ("optimizer_steps", "trained_tokens")  # counted here, from the groups verl trains on
assert set(VERL_METRICS) | set(COUNTED) == set(UPDATE_METRICS)
# Beyond UPDATE_METRICS: columns the embedded backend's record has too, given its name where verl reports them, so
# that one column (and the dashboard's Training health panel) reads both backends' runs
VERL_SHARED_METRICS = {"ppo_kl": "actor/ppo_kl"}  # mean of behaviour minus current log-probs: KL to the rollout
# verl's actor reports the most torch reserved on its card since it started (the update's peak, and the vLLM server's
# memory beside it is not counted), in GiB; the record's gpu_memory_train_gb is in GB (1e9 bytes)
VERL_MEMORY_METRICS = {"gpu_memory_train_gb": "actor/perf/max_memory_reserved_gb"}


class VerlConfigError(ValueError):
    pass


def validate_verl_config(rollout_name: str, free_cache_engine: bool, delay: int, calculate_log_probs: bool = True):
    """Refuse rollout settings under which the engine would not hold alpha between syncs."""
    if not calculate_log_probs:
        raise VerlConfigError("BAPO needs the behaviour log-probs of the rollout engine: set "
                              "actor_rollout_ref.rollout.calculate_log_probs=True")
    if delay > 1 and rollout_name == "sglang":
        raise VerlConfigError("delay>1 (BAPO's delayed rollout policy) is not supported with SGLang in verl 0.9.1: "
                              "its colocated engine cannot keep stale weights across sleep; use rollout.name=vllm "
                              "with free_cache_engine=False")
    if delay > 1 and free_cache_engine:
        raise VerlConfigError("delay>1 needs actor_rollout_ref.rollout.free_cache_engine=False: colocated vLLM sleeps "
                              "at level 2 and discards its weights, so skipping a sync would generate with garbage "
                              "weights")


def object_array(values) -> np.ndarray:
    """A 1-d object array (np.array would turn equal-length lists into a 2-d array)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def build_raw_prompt(row: dict, processor=None) -> list[dict]:
    """`raw_prompt` exactly as verl's RLHFDataset builds it (its own `_build_messages`): `<image>` -> image parts."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    fake = SimpleNamespace(image_key="images", video_key="videos", audio_key="audios", processor=processor)
    return RLHFDataset._build_messages(fake, copy.deepcopy({k: v for k, v in row.items() if k != "images"})
                                       | {"images": row.get("images")}, "prompt")


def vision_inputs(raw_prompt: list[dict], processor) -> list:
    """The images exactly as verl's agent loop hands them to the processor (RLHFDataset.process_vision_info:
    qwen_vl_utils resizes each to the patch grid first), so the update batch sees the pixels the engine saw."""
    from qwen_vl_utils import process_vision_info

    patch = getattr(getattr(processor, "image_processor", None), "patch_size", 14)
    images, _ = process_vision_info(raw_prompt, image_patch_size=patch, return_video_metadata=True)
    return images


def multi_modal_inputs(processor_output) -> dict:
    """The per-sample `multi_modal_inputs` as verl's agent loop stores them (`_compute_multi_modal_inputs`): the
    processor's tensors without input_ids / attention_mask, plus `images_seqlens` (vision tokens per image).
    `mm_token_type_ids` (transformers >= 5.3) stays only until the position ids are computed, as in verl."""
    mm = {k: v for k, v in dict(processor_output).items() if k not in ("input_ids", "attention_mask")}
    thw = mm.get("image_grid_thw")
    if thw is not None:
        mm["images_seqlens"] = torch.repeat_interleave(thw[:, 1] * thw[:, 2], thw[:, 0])
    return mm


def mrope_position_ids(processor):
    """Position ids for Qwen2.5-VL style models, computed by verl's own agent-loop code
    (`AgentLoopWorker._compute_position_ids`: a text row plus the three M-RoPE rows, shape (1, 4, L)), so the update
    batch matches what verl's rollout would have produced. `processor` must come from verl's `hf_processor`, which
    binds the model's get_rope_index to it."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    if not hasattr(processor, "get_rope_index"):
        raise VerlConfigError(f"{type(processor).__name__} has no get_rope_index: load it with "
                              "verl.utils.hf_processor(model_path), which binds the model's M-RoPE index to it")
    worker = SimpleNamespace(processor=processor)

    def position_ids(input_ids, attention_mask, mm: dict):
        return AgentLoopWorker._compute_position_ids(worker, input_ids, attention_mask, dict(mm))
    return position_ids


def length_order(lengths: list[int], cell: int) -> list[int]:
    """Row indices, each consecutive block of `cell` rows sorted by length (stable); blocks keep their rows."""
    return [i for start in range(0, len(lengths), cell)
            for i in sorted(range(start, min(start + cell, len(lengths))), key=lengths.__getitem__)]


def trainable_groups(n_groups: int, group_size: int, mini_batch_size: int, dp_size: int, micro_per_gpu: int = 1) -> int:
    """How many groups of the batch verl can train on (see the module docstring)."""
    if n_groups >= mini_batch_size:
        return (n_groups // mini_batch_size) * mini_batch_size
    k = n_groups
    while k > 0 and (k * group_size) % (dp_size * micro_per_gpu):
        k -= 1
    return k


class VerlBackend:
    """Backend over verl workers, sampling and training as the config's groups say (config.SamplingSettings,
    OptimSettings, LossConfig; verl's own options went into verl's config, verl_launch.compose), for BAPO's `delay`
    and `use_x2`. `rollout_manager`: generate_sequences(DataProto) -> DataProto (verl's
    AgentLoopManager); `actor`: update_actor(DataProto) -> DataProto and, for X2 with delay>1,
    save_model_to_cpu / restore_model_from_cpu / clear_cpu_model (verl's DetachActorWorker), compute_ref_log_prob and
    compute_log_prob when KL / truncated IS are on; `checkpoint_manager`: update_weights(global_steps) (verl's
    CheckpointEngineManager). Tests pass stand-ins; `build_verl_workers` below builds the real ones."""
    name = "verl"


    def __init__(self, sampling, optim, loss, rollout_manager, actor, checkpoint_manager, tokenizer, processor=None, *,
                 task_name: str, delay: int, use_x2: bool, divisor: int = 1, dp_size: int = 1,
                 mini_batch_size: int | None = None, micro_batch_size_per_gpu: int = 1,
                 rollout_name: str = "vllm", free_cache_engine: bool = False, position_ids_fn=None,
                 profile_steps: tuple[int, ...] = ()):
        validate_verl_config(rollout_name, free_cache_engine, delay)
        if optim.critic:
            raise VerlConfigError("critic=True (BA-PPO) runs on the embedded backend only: verl's critic worker is "
                                  "not wired into VerlBackend")
        self.sampling, self.optim, self.loss = sampling, optim, loss
        self.rollout_manager, self.actor, self.checkpoint_manager = rollout_manager, actor, checkpoint_manager
        self.tokenizer, self.processor = tokenizer, processor
        self.timings: Counter = Counter()  # seconds inside generate: all "sample" (vLLM returns the log-probs)
        self.memory: dict = {}  # the driver holds no GPU: verl's workers report theirs in the update's metrics
        self.task_name = task_name
        self.divisor, self.dp_size, self.micro_per_gpu = divisor, dp_size, micro_batch_size_per_gpu
        self.mini_batch_size = mini_batch_size or optim.mini_batch_size
        sequences = self.mini_batch_size * sampling.group_size
        if sequences % (dp_size * micro_batch_size_per_gpu):
            raise VerlConfigError(f"mini_batch_size*group_size={sequences} sequences must "
                                  f"be divisible by the data-parallel size {dp_size} times ppo_micro_batch_size_per_gpu "
                                  f"{micro_batch_size_per_gpu}")
        self.snapshots = delay > 1 and use_x2
        if self.snapshots and not all(hasattr(actor, m) for m in ("save_model_to_cpu", "restore_model_from_cpu")):
            raise VerlConfigError("re-evaluation (use_x2) with delay>1 needs an actor worker with save_model_to_cpu / "
                                  "restore_model_from_cpu (verl.experimental.separation.engine_workers.DetachActorWorker)"
                                  " to put the stale rollout weights back after the temporary sync")
        if position_ids_fn is None and processor is not None:
            position_ids_fn = mrope_position_ids(processor)
        self.position_ids_fn = position_ids_fn
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # Versions are the trainer's; this backend only knows whether the actor moved since alpha was pushed, and
        # tags weight pushes with the last training step it saw (verl uses global_steps for logging only).
        self.alpha_stale = False
        self.step = 0
        self.calls = []  # (what, step) log of weight movements, for tests
        # A colocated engine with free_cache_engine (v = 1 only) frees its memory for the actor's passes, as verl's
        # fit() has it sleep between generation and the update; the next weight push wakes it.
        self.free_cache_engine = free_cache_engine
        self.engine_asleep = False
        # verl's global_profiler.steps: the actor's passes of these steps run under verl's profiler (as fit() does;
        # generation runs in the engines, which verl profiles on their own)
        self.profile_steps = tuple(profile_steps)
        if self.snapshots:  # the engine starts with the actor's initial weights: that is alpha until the first sync
            actor.save_model_to_cpu(ALPHA)

    # --- prompts ---------------------------------------------------------------------------------------------

    def encode(self, problem: Problem) -> dict:
        """The verl row (non-tensor fields, images as PIL inside raw_prompt) and the prompt's token ids (and
        multi-modal inputs) as the agent loop tokenises it, for rebuilding the update batch."""
        row = problem_to_row(problem, self.task_name, index=0)
        raw_prompt = build_raw_prompt(row, self.processor)
        extra = row["extra_info"]
        fields = {"raw_prompt": raw_prompt, "data_source": row["data_source"], "reward_model": row["reward_model"],
                  "extra_info": extra, "index": extra["index"], "tools_kwargs": {}, "interaction_kwargs": {},
                  "uid": problem.uid}
        mm = None
        if self.processor is not None and problem.images:
            text = self.processor.apply_chat_template(raw_prompt, add_generation_prompt=True, tokenize=False)
            out = self.processor(text=[text], images=vision_inputs(raw_prompt, self.processor), return_tensors="pt")
            ids = out["input_ids"][0]
            mm = multi_modal_inputs(out)
        else:
            text = self.tokenizer.apply_chat_template(raw_prompt, add_generation_prompt=True, tokenize=False)
            ids = torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) > self.sampling.max_prompt_length:
            raise ValueError(f"prompt {problem.uid} has {len(ids)} tokens (images included), more than "
                             f"max_prompt_length={self.sampling.max_prompt_length}")
        return {"row": fields, "input_ids": ids, "multi_modal_inputs": mm}

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # --- generation ------------------------------------------------------------------------------------------

    def prompts_to_dataproto(self, prompts: list[dict], n: int):
        from verl import DataProto

        rows = [p["row"] for p in prompts]
        batch = DataProto.from_dict(
            tensors={"dummy_tensor": torch.zeros(len(rows), 1, dtype=torch.uint8)},
            non_tensors={k: object_array([r[k] for r in rows]) for k in ROW_KEYS},
            meta_info={"global_steps": self.step})
        return batch.repeat(repeat_times=n, interleave=True)

    def generate(self, prompts: list[dict], n: int, policy: Policy = "rollout", *, greedy: bool = False,
                 logprobs: bool = True) -> list[list[Response]]:
        from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto

        if greedy:
            raise VerlConfigError("greedy decoding is not wired into the verl backend: evaluate with `bapo eval` "
                                  "(embedded backend) on the run's final/ policy")
        batch = self.prompts_to_dataproto(prompts, n)
        padded, pad = pad_dataproto_to_divisor(batch, self.divisor)
        temporary = policy == "current" and self.alpha_stale
        t0 = time.perf_counter()
        if self.engine_asleep:  # only with v = 1, where alpha is pi_theta: the push restores what sleep discarded
            self._push("wake")
        if temporary:  # X2: pi_theta into the engine for this call only
            self._push("reeval_sync")
        try:
            out = unpad_dataproto(self.rollout_manager.generate_sequences(padded), pad)
        finally:
            if temporary:
                self._restore_alpha()
            self.timings["sample"] += time.perf_counter() - t0
        if "rollout_log_probs" not in out.batch.keys():
            raise VerlConfigError("the rollout returned no rollout_log_probs: set "
                                  "actor_rollout_ref.rollout.calculate_log_probs=True")
        P = out.batch["prompts"].shape[1]
        valid = out.batch["attention_mask"][:, P:].bool()
        responses, scores = out.batch["responses"], out.batch["rollout_log_probs"]
        flat = [Response(tuple(responses[i][m].tolist()), tuple(scores[i][m].float().tolist()) if logprobs else None)
                for i, m in enumerate(valid)]
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    # --- weights ---------------------------------------------------------------------------------------------

    def _load_engine(self):
        """The actor's weights into the engine (verl's weight push, which also wakes a sleeping engine)."""
        self.checkpoint_manager.update_weights(global_steps=self.step)
        self.engine_asleep = False

    def _push(self, what: str):
        self._load_engine()
        self.calls.append((what, self.step))

    def _sleep_engine(self):
        if self.free_cache_engine and not self.engine_asleep:
            self.checkpoint_manager.sleep_replicas()
            self.engine_asleep = True

    def sync(self):
        """alpha <- pi_theta: one weight push; with X2 also the CPU snapshot alpha is restored from later."""
        self._push("sync")
        self.alpha_stale = False
        if self.snapshots:
            if hasattr(self.actor, "clear_cpu_model"):
                self.actor.clear_cpu_model(ALPHA)
            self.actor.save_model_to_cpu(ALPHA)

    def _restore_alpha(self):
        """Put the stale alpha back into the engine after a temporary sync, leaving the actor as it was."""
        self.actor.save_model_to_cpu(CURRENT)
        self.actor.restore_model_from_cpu(ALPHA)
        try:
            self._push("reeval_restore")
        finally:
            self.actor.restore_model_from_cpu(CURRENT)
            if hasattr(self.actor, "clear_cpu_model"):
                self.actor.clear_cpu_model(CURRENT)

    # --- update ----------------------------------------------------------------------------------------------

    def batch_to_dataproto(self, batch: UpdateBatch, cell: int | None = None):
        """The update batch: [left pad][prompt][response][right pad], old_log_probs = stored behaviour log-probs.
        `cell`: the rows one rank trains in one optimizer step (verl hands each rank a contiguous share and cuts it
        into mini-batches, then micro-batches, in order); within each cell the rows go by length, so that a
        micro-batch holds neighbours in length and is padded little, while each optimizer step trains the same
        sequences as in group order (the embedded backend orders its micro-batches the same way)."""
        from verl import DataProto
        from verl.utils.model import compute_position_id_with_mask

        rows = batch.sequences()
        if cell:
            lengths = [len(p["input_ids"]) + len(r.tokens) for _, p, r, _, _ in rows]
            rows = [rows[i] for i in length_order(lengths, cell)]
        tokens = [r.tokens for _, _, r, _, _ in rows]
        packed = pack([p["input_ids"] for _, p, *_ in rows], tokens, self.pad_id, min_response=1)
        input_ids, attention_mask, response_mask = packed.input_ids, packed.attention_mask, packed.response_mask
        old = right_pad([r.logprobs for _, _, r, _, _ in rows], packed.R)
        adv = torch.tensor([a for *_, a in rows], dtype=torch.float32)[:, None] * response_mask
        mm = [p.get("multi_modal_inputs") for _, p, *_ in rows]
        if any(m is not None for m in mm):
            if self.position_ids_fn is None:
                raise VerlConfigError("vision-language updates need position_ids_fn (M-RoPE positions, as verl's "
                                      "agent loop computes them)")
            position_ids = torch.cat([self.position_ids_fn(input_ids[i:i + 1], attention_mask[i:i + 1], mm[i] or {})
                                      for i in range(len(rows))])
            mm = [{k: v for k, v in (m or {}).items() if k != "mm_token_type_ids"} for m in mm]
        else:
            position_ids = compute_position_id_with_mask(attention_mask)
        non_tensors = {"uid": object_array([str(g) for g, *_ in rows])}
        meta = {"temperature": self.sampling.temperature, "global_steps": batch.step,
                "global_token_num": attention_mask.sum(-1).tolist()}
        if any(m for m in mm if m):
            non_tensors["multi_modal_inputs"] = object_array(mm)
            meta["images_seqlens"] = [n for m in mm if "images_seqlens" in m for n in m["images_seqlens"].tolist()]
        return DataProto.from_dict(
            tensors={"prompts": input_ids[:, :packed.P], "responses": input_ids[:, packed.P:], "input_ids": input_ids,
                     "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": response_mask,
                     "old_log_probs": old, "advantages": adv},
            non_tensors=non_tensors, meta_info=meta)

    def update(self, batch: UpdateBatch) -> UpdateResult:
        if batch.advantages is None:
            raise VerlConfigError("the verl backend needs the trainer's advantages (critic=True is embedded-only)")
        self.step = batch.step
        keep = trainable_groups(len(batch), self.sampling.group_size, self.mini_batch_size, self.dp_size,
                                self.micro_per_gpu)
        metrics = {"trimmed_groups": len(batch) - keep}
        if keep == 0:
            return UpdateResult(changed=False, metrics=metrics)
        profiling = batch.step in self.profile_steps
        if profiling:  # outside the parts of t_train timed below
            self.actor.start_profile(batch.step)
        t0 = time.perf_counter()
        cell = min(self.mini_batch_size, keep) * self.sampling.group_size // self.dp_size
        data = self.batch_to_dataproto(batch.select(list(range(keep))), cell)
        t1 = time.perf_counter()
        self._sleep_engine()  # before any of the actor's passes
        t2 = time.perf_counter()
        behaviour = data.batch["old_log_probs"]
        with named("verl's log-prob pass (the proximal policy's or the reference's)",
                   "lower verl.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu (the proximal policy) or "
                   "verl.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu (the reference)"):
            old, is_w = old_logprobs(behaviour, self.optim.tis_threshold,
                                     lambda: self.actor.compute_log_prob(data).batch["old_log_probs"])
            if is_w is not None:  # ratio against the proximal policy, truncated IS to alpha
                data.batch["old_log_probs"], data.batch["rollout_log_probs"] = old, behaviour
                data.batch["rollout_is_weights"] = is_w * data.batch["response_mask"]
            if self.loss.kl_coef > 0:
                data = data.union(self.actor.compute_ref_log_prob(data))
        t3 = time.perf_counter()
        with named(f"verl's update (ppo_micro_batch_size_per_gpu={self.micro_per_gpu})",
                   "lower verl.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, set "
                   "verl.actor_rollout_ref.model.enable_gradient_checkpointing=true, or spread the update over more "
                   "GPUs (verl.trainer.n_gpus_per_node, verl.trainer.nnodes)"):
            out = self.actor.update_actor(data)
        t4 = time.perf_counter()
        if profiling:  # verl's finish hook (global_profiler.finish_hook_cmd) runs after the last profiled step only
            self.actor.stop_profile(last=batch.step == max(self.profile_steps))
        # where the record's t_train went: building verl's batch, putting the engine to sleep, the proximal and
        # reference log-probs, and verl's update_actor call (with FSDP offload, its moves of weights and optimizer
        # state between host and card are inside it)
        metrics |= {"t_train_batch": t1 - t0, "t_train_engine_sleep": t2 - t1, "t_train_logprobs": t3 - t2,
                    "t_train_actor": t4 - t3}
        metrics["optimizer_steps"] = self.optim.epochs * max(1, keep // self.mini_batch_size)
        metrics["trained_tokens"] = int(data.batch["attention_mask"].sum())
        self.alpha_stale = True
        verl_metrics = {k: float(np.mean(v)) if isinstance(v, (list, tuple, np.ndarray)) else float(v)
                        for k, v in (out.meta_info.get("metrics", {}) if out is not None else {}).items()}
        return UpdateResult(changed=True, metrics=metrics | verl_metrics | self._record_names(verl_metrics))

    def _record_names(self, verl_metrics: dict) -> dict:
        """UPDATE_METRICS (and VERL_SHARED_METRICS, VERL_MEMORY_METRICS where verl reports them) from verl's names; kl
        is 0.0 without a KL term (as on the embedded backend)."""
        out = {}
        for ours, names in VERL_METRICS.items():
            value = next((verl_metrics[n] for n in names if n in verl_metrics), None)
            if value is None and ours == "kl" and self.loss.kl_coef == 0:
                value = 0.0
            if value is None:
                log.warning("verl's actor returned none of %s: the record's %s column stays empty", names, ours)
                value = float("nan")
            out[ours] = value
        return out | {ours: verl_metrics[n] for ours, n in VERL_SHARED_METRICS.items() if n in verl_metrics} | {
            ours: verl_metrics[n] * 2**30 / 1e9 for ours, n in VERL_MEMORY_METRICS.items() if n in verl_metrics}

    # --- checkpoints -----------------------------------------------------------------------------------------

    def save_checkpoint(self, path, step: int):
        """verl checkpoint of pi_theta (+ optimizer) in path/actor and, while alpha is stale, of alpha's weights in
        path/alpha (restored from the CPU snapshot), so a resumed run generates with the same alpha; this backend's
        bookkeeping in path/verl_backend.json."""
        self.actor.save_checkpoint(f"{path}/actor", global_step=step)
        if self.snapshots and self.alpha_stale:
            self.actor.save_model_to_cpu(CURRENT)
            self.actor.restore_model_from_cpu(ALPHA)
            self.actor.save_checkpoint(f"{path}/alpha", global_step=step)
            self.actor.restore_model_from_cpu(CURRENT)
        Path(path, BOOKKEEPING).write_text(json.dumps({"alpha_stale": self.alpha_stale, "step": self.step,
                                                       "calls": list(self.calls)}))

    def load_checkpoint(self, path, policy_only: bool = False):
        """Inverse of save_checkpoint: engine <- alpha, actor <- pi_theta. policy_only: pi_theta from path/actor,
        pushed to the engine (it generates with it from now on)."""
        if policy_only:
            self.actor.load_checkpoint(f"{path}/actor")
            self.sync()
            return
        state = json.loads(Path(path, BOOKKEEPING).read_text())
        self.alpha_stale, self.step, self.calls = state["alpha_stale"], state["step"], list(state["calls"])
        if self.snapshots and Path(path, "alpha").is_dir():
            self.actor.load_checkpoint(f"{path}/alpha")
        else:
            self.actor.load_checkpoint(f"{path}/actor")
        self._load_engine()
        if self.snapshots:
            self.actor.save_model_to_cpu(ALPHA)
        self.actor.load_checkpoint(f"{path}/actor")

    def save_pretrained(self, path):
        """pi_theta in Hugging Face format: verl's actor checkpoint in path/actor, merged into path by verl's own
        model merger (`python -m verl.model_merger merge --backend fsdp`), so from_pretrained(path) loads it."""
        from verl.model_merger.base_model_merger import ModelMergerConfig
        from verl.model_merger.fsdp_model_merger import FSDPModelMerger

        self.actor.save_checkpoint(f"{path}/actor", global_step=self.step)
        merger = FSDPModelMerger(ModelMergerConfig(operation="merge", backend="fsdp", local_dir=f"{path}/actor",
                                                   target_dir=str(path),
                                                   hf_model_config_path=f"{path}/actor/huggingface"))
        merger.merge_and_save()
        merger.cleanup()


def build_verl_workers(vcfg):
    """The real workers, from inside the Ray task runner: returns (RayPPOTrainer, kwargs for VerlBackend).
    The actor-rollout worker is bapo_vl.backends.verl_workers.ActorWorker (verl's DetachActorWorker); called by
    bapo_vl.verl_launch.run."""
    from verl.trainer.main_ppo_v0 import TaskRunner
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import Role
    from verl.utils.config import omega_conf_to_dataclass

    from bapo_vl.backends.verl_workers import ActorWorker

    runner = TaskRunner.__ray_actor_class__()  # its helpers, run in this process
    _, group_cls = runner.add_actor_rollout_worker(vcfg)
    import ray
    for role in list(runner.role_worker_mapping):
        if role in (Role.ActorRollout, Role.ActorRolloutRef):
            runner.role_worker_mapping[role] = ray.remote(ActorWorker)
    runner.add_ref_policy_worker(vcfg, runner.role_worker_mapping.get(Role.ActorRollout))
    model_config = omega_conf_to_dataclass(vcfg.actor_rollout_ref.model)
    # verl's own dataloaders are never iterated (our PromptSampler feeds the Trainer): placeholders of the right
    # length stand in for data.train_files / val_files
    placeholder = [{}] * vcfg.data.train_batch_size
    trainer = RayPPOTrainer(config=vcfg, tokenizer=model_config.tokenizer, processor=model_config.processor,
                            role_worker_mapping=runner.role_worker_mapping,
                            resource_pool_manager=runner.init_resource_pool_mgr(vcfg), ray_worker_group_cls=group_cls,
                            train_dataset=placeholder, val_dataset=placeholder[:1])
    trainer.init_workers()
    trainer.checkpoint_manager.update_weights(0)  # engine <- initial actor weights (as fit() does first)
    rollout = vcfg.actor_rollout_ref.rollout
    n_gpus = vcfg.trainer.n_gpus_per_node * vcfg.trainer.nnodes
    return trainer, dict(
        rollout_manager=trainer.async_rollout_manager, actor=RayTrainerActor(trainer),
        checkpoint_manager=trainer.checkpoint_manager, tokenizer=model_config.tokenizer,
        processor=model_config.processor, divisor=rollout.agent.num_workers, dp_size=n_gpus,
        micro_batch_size_per_gpu=vcfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu or 1,
        rollout_name=rollout.name, free_cache_engine=rollout.free_cache_engine,
        profile_steps=profiled_steps(vcfg))


def profiled_steps(vcfg) -> tuple[int, ...]:
    """The steps whose actor passes run under verl's profiler: `global_profiler.steps` once a tool is set (fit()'s
    rule; the actor's `profiler.enable` and `tool_config` say what is recorded, and where)."""
    profiler = vcfg.global_profiler
    return tuple(int(s) for s in profiler.steps or ()) if profiler.tool else ()


class RayTrainerActor:
    """The actor side as VerlBackend calls it: RayPPOTrainer's DataProto<->TensorDict helpers plus the worker group."""

    def __init__(self, trainer):
        self.trainer, self.wg = trainer, trainer.actor_rollout_wg

    def update_actor(self, batch):
        """RayPPOTrainer._update_actor, with the mini-batch cut to the batch when the batch is smaller than one
        (VerlBackend's trimming keeps such a batch as one smaller optimizer step; verl asserts whole mini-batches)."""
        from omegaconf import open_dict

        actor = self.trainer.config.actor_rollout_ref.actor
        configured, groups = actor.ppo_mini_batch_size, len(batch) // self.trainer.config.actor_rollout_ref.rollout.n
        with open_dict(actor):
            actor.ppo_mini_batch_size = min(configured, groups)
        try:
            return self.trainer._update_actor(batch)
        finally:
            with open_dict(actor):
                actor.ppo_mini_batch_size = configured

    def compute_log_prob(self, batch):
        return self.trainer._compute_old_log_prob(batch)[0]

    def start_profile(self, step: int):
        self.trainer.global_steps = step  # the trace's file name carries it
        self.trainer._start_profiling(True)

    def stop_profile(self, last: bool):
        self.trainer._stop_profiling(True, run_command=last)

    def compute_ref_log_prob(self, batch):
        return self.trainer._compute_ref_log_prob(batch)

    def save_model_to_cpu(self, n):
        self.wg.save_model_to_cpu(n)

    def restore_model_from_cpu(self, n):
        self.wg.restore_model_from_cpu(n)

    def clear_cpu_model(self, n):
        self.wg.clear_cpu_model(n)

    def save_checkpoint(self, local_path, global_step=0):
        self.wg.save_checkpoint(local_path, None, global_step, None)

    def load_checkpoint(self, local_path):
        self.wg.load_checkpoint(local_path, None, False)
