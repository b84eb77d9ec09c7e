"""GPU benchmark of the backends on the same shapes: per-step time split and tokens/s of the embedded backend (as it
is), BAPO on verl with 1 GPU and with 2 GPUs, and the bandwidth bound of decode for each shape.

    python scripts/gpu/bench_backends.py models DIR [--shapes vl3b]        # random text-0.5B and VL shapes, saved
    python scripts/gpu/bench_backends.py train --shape math --backend embedded --model DIR/math --source F --out F.json
    python scripts/gpu/bench_backends.py bound --shape text --model DIR/text --out F.json
    python scripts/gpu/bench_backends.py train --shape text --backend embedded --model DIR/text --out F.json
    python scripts/gpu/bench_backends.py train --shape text --backend verl --gpus 2 --model DIR/text --out F.json
    python scripts/gpu/bench_backends.py report F.json ...                 # the table, ratios against embedded
    python scripts/gpu/bench_backends.py summary F.json --baseline B.json  # one row as JSON, EasyR1's figures
    python scripts/gpu/bench_backends.py train ... --check                 # the run's config, composed, not run
    python scripts/gpu/bench_backends.py train --backend verl ... --profile-step 2   # + what the GPU did in the
                                            # update's first mini-batch (scripts/gpu/trace_summary.py)

Shapes (random weights, byte vocabulary; every group is trained on: online_filter=none, no re-evaluation within the
run, kl_coef=0 so neither backend keeps a reference model):
  text  Qwen2-0.5B (hidden 896, 24 layers, 14/2 heads): countdown, 64 prompts x 8 x up to 512 response tokens
        (`models` also saves text151k, the same with Qwen2's 151,936-word vocabulary, for `bench_gpu.py update`)
  vl    Qwen2.5-VL-3B's vision tower (32 blocks, hidden 1280) and head dimension 128 under a 1.5B-class language
        model (hidden 1536, 28 layers, 12/2 heads), 2.0 B parameters: Geometry3K diagrams at up to 448x448 pixels
        (<= 256 visual tokens), 16 prompts x 8 x up to 256 response tokens. The 3B language model does not fit the
        embedded backend's fp32 AdamW on an 80 GB card next to its bf16 rollout copy.
  vl3b  Qwen2.5-VL-3B's architecture (3.75 B: language model hidden 2048, 36 layers, 16/2 heads, intermediate 11008,
        tied embeddings of 151,936 rows; the 32-block vision tower with window attention) at EasyR1's per-GPU
        setting (examples/config.yaml, qwen2_5_vl_3b_geo3k_grpo.sh: 512 prompts x n=5 on 8 GPUs): 64 prompts x 5 per
        GPU (`--gpus N`: 64 N prompts, mini-batches of 16 N prompts, EasyR1's 4 optimizer steps per step), prompts
        and responses up to 2048 tokens, Geometry3K diagrams resized to 262,144..4,194,304 pixels, on-policy
        (delay=1, no X2 or X3: the grpo algorithm) as EasyR1's GRPO. The byte tokenizer has 263 ids; the vocabulary is padded to the real 151,936 so
        that embedding, LM head, their FLOPs and their AdamW state are the real model's. With random weights EOS is
        one draw in 151,936, so the embedded backend's responses run to the 2048-token budget: a step is the
        setting's longest; compare tokens/s per GPU with EasyR1's, not seconds per step. verl's engine samples only
        the tokenizer's 263 ids (it masks the rest), so its responses end after about 300 tokens.
        Differences from EasyR1: no KL term (kl_coef 0: no
        reference model; EasyR1 runs one at 1e-2), vLLM tensor parallel 1 (EasyR1: 2), top_p 1.
        Memory (GB = 1e9 bytes) of the embedded backend on one card: fp32 weights 15.0 + AdamW 30.0 stay resident
        (delay=1: no rollout copy; kl_coef 0: no reference copy); generation adds vLLM's share of the card
        (gpu_memory_utilization 0.3: its bf16 weights 7.5 + KV cache at 36,864 bytes a token), asleep during the
        update; the update adds fp32 gradients 15.0, autocast's bf16 weight casts 7.5 (held through forward and
        backward) and one micro-batch's activations: without activation checkpointing about 36 h + 10 i bytes a
        token a layer (h 2048, i 11008: 184 KB, x 36 layers = 6.6 MB a token), for one sequence of ~2,600 tokens
        (micro_batch_size=1) ~17 GB: ~85 GB in all, the whole of an 80 GB card (81,559 MiB) before CUDA's context
        and fragmentation, so expect the embedded rows to run out of memory there and to fit a 141 GB card.
        mixed_precision=compute_copy would hold more, not less (a bf16 copy 7.5 resident + its bf16 gradients 7.5
        in the backward). verl, per GPU: EasyR1's FSDP settings (parameters and optimizer offloaded to the CPU
        outside the update, gradient checkpointing, log-prob micro-batches of 16, vLLM at 0.6 of the card, freed
        during the update); the update holds 60.0 / N GB of fp32 state per card. Update micro-batches of 8 (EasyR1:
        4) through verl's fused log-probs (`use_fused_kernels`: the LM head and log-softmax by chunks of tokens):
        verl's update is bound by the host's kernel launches, about as many a micro-batch whatever its rows, and
        without the fused path 8 rows' fp32 logits (8 x ~2,600 tokens x 151,936) outgrow a 141 GB card.
  math, countdown, geometry3k  the paper's presets as users run them (`bapo train --preset NAME`), 8 prompts a
        step, on random weights of their models' architectures (`models` saves math, DeepSeek-R1-Distill-Qwen-1.5B's
        with its own LM head, and countdown, Qwen2.5-Math-1.5B's; geometry3k runs on vl3b, Qwen2.5-VL-3B's): random
        weights run each response to the preset's cap and solve nothing (online_filter=none: every group is trained
        on), so a step holds the most the preset can ask of a card. The row's `gpu_memory_gb` (the record's, by
        phase) and `peak_gpu_memory_gb` (nvidia-smi) say whether the preset fits a card: more prompts a step take
        longer, not more memory (but for the batch's per-token terms on the device, 67 MB a float tensor at 256 x 8 x
        8,192 tokens).

A `train` run is `bapo train` (embedded) or `python -m bapo_vl.backends.verl_main` (verl) for --steps steps; figures
come from its run record (t_generate, t_verify, t_train, t_sync, rollouts, response_length, step wall times); step 1
(warm-up, CUDA graphs / compilation) and a `--profile-step` are left out of the medians (`timed_steps` says which
steps they are: profile step 2 of 5 for three timed steps).

Needs bapo-vl installed (`pip install -e .`) and, for the verl rows, its `[verl]` and `[vllm]` extras
(`pip install -e ".[verl,vllm]"`). Run it from outside the checkout, so that Ray's workers import the installed
package (and load its verl plugin through the entry point) rather than the source folder.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import trace_summary  # beside this file

REPO = Path(__file__).resolve().parents[2]
TEXT = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864)
VL_TEXT = dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960)
VL3B_TEXT = dict(hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab_size=151936)
MAX_PIXELS = 448 * 448
EASYR1_PIXELS = dict(min_pixels=262144, max_pixels=4194304)  # EasyR1's examples/config.yaml

COMMON = dict(online_filter="none", reeval_every=100000, kl_coef=0.0, entropy_coef=0.0, lr=1e-6, device="cuda",
              save_every=-1, log_samples=2)
# The verl presets the shapes start from are functional runs with vLLM in eager mode (no compile, no CUDA graphs:
# short runs); a benchmark runs vLLM as users do, as the embedded backend's vLLM engine does. Results recorded before
# this override ran eager: the report says so for results that do not name the mode.
VLLM_AS_USERS_RUN_IT = {"actor_rollout_ref.rollout.enforce_eager": False}

SHAPES = {
    "text": dict(preset="tiny", verl_preset="verl_tiny.yaml", prompt_tokens=64,
                 bapo=dict(COMMON, batch_size=64, group_size=8, max_prompt_length=64, max_response_length=512,
                           mini_batch_size=64, micro_batch_size=16),
                 verl={"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 16, **VLLM_AS_USERS_RUN_IT}),
    "vl": dict(preset="geometry3k", verl_preset="verl_tiny_vl.yaml", prompt_tokens=400,
               bapo=dict(COMMON, batch_size=16, group_size=8, max_prompt_length=1024, max_response_length=256,
                         mini_batch_size=16, micro_batch_size=8, max_pixels=MAX_PIXELS),
               verl={"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
                     "actor_rollout_ref.rollout.gpu_memory_utilization": 0.35, **VLLM_AS_USERS_RUN_IT}),
    # per_gpu: the fields multiplied by --gpus (EasyR1's setting is per GPU); prompt_tokens: the bound's estimate
    "vl3b": dict(preset="geometry3k", verl_preset="verl_tiny_vl.yaml", prompt_tokens=600,
                 per_gpu=("batch_size", "mini_batch_size"),
                 bapo=dict(COMMON, delay=1, use_x2=False, use_x3=False, batch_size=64, group_size=5,
                           max_prompt_length=2048, max_response_length=2048, mini_batch_size=16, weight_decay=0.01,
                           micro_batch_size=1, score_batch_size=16, generate_batch_size=128, **EASYR1_PIXELS),
                 verl={"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
                       "actor_rollout_ref.model.use_fused_kernels": True,
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 16,
                       "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
                       "actor_rollout_ref.rollout.free_cache_engine": True,  # delay=1: vLLM may free its memory
                       "actor_rollout_ref.actor.fsdp_config.param_offload": True,
                       "actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
                       **VLLM_AS_USERS_RUN_IT}),
}
# The presets' models' architectures: DeepSeek-R1-Distill-Qwen-1.5B (untied LM head, 1.78 B) and Qwen2.5-Math-1.5B
# (tied, 1.54 B), over the byte tokenizer padded to their 151,936 rows
TEXT_1_5B = dict(VL_TEXT, vocab_size=151936, max_position_embeddings=131072)
PRESET_RUN = dict(batch_size=8, online_filter="none", device="cuda", save_every=-1, log_samples=2)
SHAPES |= {
    # a paper preset as users run it, at 8 prompts a step (its lengths, micro-batches, checkpointing, delay and KL
    # reference: what a card must hold; more prompts a step take longer, not more memory, but for the per-token
    # terms of the batch): the record's gpu_memory_* and the card's peak
    "math": dict(preset="math", verl_preset="verl_math.yaml", prompt_tokens=300, bapo=PRESET_RUN, verl={}),
    "countdown": dict(preset="countdown", verl_preset="verl_countdown.yaml", prompt_tokens=120, bapo=PRESET_RUN,
                      verl={}),
    "geometry3k": dict(preset="geometry3k", verl_preset="verl_geometry3k.yaml", prompt_tokens=600, bapo=PRESET_RUN,
                       verl={}),
}
MODELS = {  # the `models` subcommand's random-weight models, by shape
    "text": dict(TEXT),
    # the text shape with Qwen2's 151,936-word vocabulary (text's is the byte tokenizer's 263 words): the update's
    # LM head (full-vocabulary log-softmax, entropy and their backward) at a real model's size
    "text151k": dict(TEXT, vocab_size=151936),
    "vl": dict(VL_TEXT, vision="VISION_3B", max_pixels=MAX_PIXELS),
    "vl3b": dict(VL3B_TEXT, vision="VISION_3B", **EASYR1_PIXELS),
    "math": dict(TEXT_1_5B, tie_word_embeddings=False),
    "countdown": dict(TEXT_1_5B, max_position_embeddings=4096),
}


def card() -> str:
    import torch
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"


class GpuMemoryPeak:
    """The most memory each of `cards` (nvidia-smi's indices, comma-separated) had in use while the block ran, as
    nvidia-smi reports it: every process on the card, vLLM's reserved pool included. Polled every `every` seconds in
    a thread; `peak_gb` is {card: GB}, None where nvidia-smi is missing or never answered."""

    def __init__(self, cards: str, every: float = 1.0):
        self.cards, self.every = cards, every
        self.peak: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while True:
            try:
                text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                       "-i", self.cards], capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.TimeoutExpired):
                return  # no nvidia-smi (or a hung one): no figure, the run goes on
            for index, mib in parse_memory_used(text).items():
                self.peak[index] = max(self.peak.get(index, 0.0), mib)
            if self._stop.wait(self.every):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def peak_gb(self) -> dict[int, float] | None:
        return {i: mib * 2 ** 20 / 1e9 for i, mib in sorted(self.peak.items())} or None


def parse_memory_used(text: str) -> dict[int, float]:
    """{card index: MiB used} from `nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits` lines;
    lines that are not two numbers (a card that reports [N/A]) are left out."""
    out = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out[int(parts[0])] = float(parts[1])
            except ValueError:
                continue
    return out


def build(shape: str, **change):
    """The shape's random-weight model and its tokenizer / processor; `change` replaces settings (smaller ones
    for a CPU check)."""
    from bapo_vl import tiny

    spec = dict(MODELS[shape], **change)
    if "vision" not in spec:
        return tiny.build_qwen2(**spec)
    if isinstance(spec.get("vision"), str):
        spec["vision"] = getattr(tiny, spec["vision"])
    return tiny.build_qwen2_5_vl(**spec)


def models(out: Path, shapes: list[str] | None = None):
    import torch

    torch.set_default_device("cuda" if torch.cuda.is_available() else "cpu")  # random init on the card, not on the CPU
    for name in shapes or MODELS:
        model, tok = build(name)
        model.to(torch.bfloat16).save_pretrained(out / name)
        tok.save_pretrained(out / name)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters, random weights -> "
              f"{out / name}", flush=True)
        del model
        torch.cuda.empty_cache()


def copy_rate(gib: float = 4.0, repeat: int = 20) -> float:
    """The card's measured device-to-device copy rate, bytes/s (read + write counted)."""
    import torch

    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * repeat / (time.perf_counter() - t0)


def bound(shape: str, model_dir: Path, out: Path):
    """Decode's bandwidth bound: each decode step reads the language model's weights (bf16) once and every row's
    KV cache; rows = prompts x G, context = prompt + half the response budget (the mean over a full decode)."""
    from transformers import AutoConfig

    spec = SHAPES[shape]
    cfg = AutoConfig.from_pretrained(model_dir)
    text = getattr(cfg, "text_config", cfg)
    head_dim = text.hidden_size // text.num_attention_heads
    lm_params = (text.num_hidden_layers * (
        text.hidden_size * head_dim * (text.num_attention_heads * 2 + text.num_key_value_heads * 2)
        + 3 * text.hidden_size * text.intermediate_size) + text.vocab_size * text.hidden_size)
    rows = spec["bapo"]["batch_size"] * spec["bapo"]["group_size"]
    context = spec["prompt_tokens"] + spec["bapo"]["max_response_length"] / 2
    kv = rows * context * text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 2
    rate = copy_rate()
    step_s = (2 * lm_params + kv) / rate
    result = dict(kind="bound", shape=shape, card=card(), copy_rate_GBps=rate / 1e9, weight_bytes=2 * lm_params,
                  kv_bytes_per_step=kv, rows=rows, mean_context=context, decode_step_ms=1e3 * step_s,
                  tokens_per_s=rows / step_s)
    _write(out, result)


def _arg(v) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def fields(shape: str, gpus: int, extra: list[str]) -> dict:
    """The run's Config fields: the shape's, the per-GPU ones times `gpus`, then the `--set` ones (not verl.*)."""
    spec = SHAPES[shape]
    bapo = dict(spec["bapo"], **{k: spec["bapo"][k] * gpus for k in spec.get("per_gpu", ())})
    bapo.update(item.split("=", 1) for item in extra if not item.startswith("verl."))
    return bapo


def command(shape: str, backend: str, gpus: int, model_dir: Path, steps: int, source: str | None, run_dir: Path,
            extra: list[str]) -> tuple[str, list[str], dict]:
    """(run name, the command that runs it, verl's overrides: {} for the embedded backend)."""
    spec = SHAPES[shape]
    engine = next((e.split("=", 1)[1] for e in extra if e.startswith("rollout_engine=")), None)
    name = f"bench-{shape}-{backend}{gpus}" + (f"-{engine}" if engine else "")
    bapo = dict(fields(shape, gpus, extra), model=str(model_dir), steps=steps, run_dir=str(run_dir), name=name)
    verl_extra = dict(item.removeprefix("verl.").split("=", 1) for item in extra if item.startswith("verl."))
    if verl_extra and backend != "verl":
        raise SystemExit(f"verl.* settings {sorted(verl_extra)} apply to --backend verl only")
    if source:
        bapo["task_options"] = {"source": source}
    if backend == "embedded":
        cli = "import sys; from bapo_vl.cli import main; sys.exit(main())"  # main() returns the exit status
        return name, [sys.executable, "-c", cli, "train", "--preset", spec["preset"],
                      *[f"{k}={_arg(v)}" for k, v in bapo.items()]], {}
    from bapo_vl.config import BACKEND_OF

    for key in ["device", *(k for k in bapo if BACKEND_OF.get(k) == "embedded")]:
        bapo.pop(key, None)  # the embedded backend's settings, refused on verl: spec["verl"] has verl's
    verl = dict(spec["verl"], **{"trainer.n_gpus_per_node": gpus}, **verl_extra)
    return name, [sys.executable, "-m", "bapo_vl.backends.verl_main", "--config",
                  str(REPO / "bapo_vl" / "presets" / spec["verl_preset"]),
                  *[f"bapo.{k}={_arg(v)}" for k, v in bapo.items()], *[f"verl.{k}={v}" for k, v in verl.items()]], verl


def check(backend: str, gpus: int, cmd: list[str]) -> dict:
    """The run's config as the command would load it (and, on verl, compose it with verl's own config and check it
    as verl's actor worker does), without running it: what can be known of a GPU run on any machine."""
    from bapo_vl.config import load_config

    if backend == "embedded":
        args = cmd[cmd.index("--preset") + 2:]
        cfg = load_config(cmd[cmd.index("--preset") + 1], None, args)
        return dict(config=cfg.to_dict())
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from bapo_vl.backends.verl_backend import validate_verl_config
    from bapo_vl.backends.verl_main import load_configs

    cfg, vcfg = load_configs(cmd[cmd.index("--config") + 1], cmd[cmd.index("--config") + 2:])
    r = vcfg.actor_rollout_ref.rollout
    validate_verl_config(r.name, r.free_cache_engine, cfg.bapo.delay)
    omega_conf_to_dataclass(vcfg.actor_rollout_ref.actor).validate(n_gpus=gpus, train_batch_size=cfg.sampling.batch_size)
    return dict(config=cfg.to_dict(), verl=OmegaConf.to_container(vcfg, resolve=False))


def profile_settings(step: int, save_path: Path) -> list[str]:
    """verl's torch profiler over the actor's passes of one step: CUDA activity (and the host's, always), the
    update's first mini-batch only (a schedule of one active mini-batch: a whole step's trace would be far larger)."""
    t = "verl.actor_rollout_ref.actor.profiler"
    return ["verl.global_profiler.tool=torch", f"verl.global_profiler.steps=[{step}]",
            f"verl.global_profiler.save_path={save_path}", f"{t}.enable=True", f"{t}.tool_config.torch.contents=[cuda]",
            f"{t}.tool_config.torch.schedule.active=1"]


EXCEPTION_LINE = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Failed)(?:\(\w+\))?: .*)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_watching_stderr(cmd: list[str], env: dict, timeout: float, keep: int = 2) -> tuple[int | str, list[str]]:
    """Run `cmd` with its stderr passed through, and return its exit status ("timeout" if it ran past `timeout`
    seconds) and the last `keep` lines of its stderr that name an exception (`torch.OutOfMemoryError: CUDA out of
    memory. ...`; Ray's and the terminal's prefixes dropped, 300 characters at most) or, without one, its last line:
    a failed row says why."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    named, last = [], [""]

    def watch():
        for line in proc.stderr:
            sys.stderr.write(line)
            text = ANSI.sub("", line).strip()
            if text:
                last[0] = text
            found = EXCEPTION_LINE.search(text)
            if found and (not named or named[-1] != found.group(1)[:300]):
                named[:] = (named + [found.group(1)[:300]])[-keep:]
    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    reader.join(timeout=10)
    return rc, named or ([last[0][:300]] if last[0] else [])


def train(shape: str, backend: str, gpus: int, model_dir: Path, steps: int, out: Path, source: str | None,
          run_dir: Path, timeout: float, extra: list[str], cuda: str | None = None, keep_weights: bool = False,
          dry: bool = False, profile_step: int | None = None):
    # save_every=-1 (COMMON): no checkpoint, no final/; a 3 B model's (fp32 + AdamW) fills tens of GB of disk
    extra = extra + ["save_every=0"] if keep_weights else extra
    traces = None
    if profile_step is not None:
        if backend != "verl":
            raise SystemExit("--profile-step profiles verl's actor; the embedded update: scripts/bench_gpu.py update "
                             "--profile")
        traces = run_dir / f"profile-{shape}-verl{gpus}-step{profile_step}"
        extra = extra + profile_settings(profile_step, traces)
    name, cmd, verl = command(shape, backend, gpus, model_dir, steps, source, run_dir, extra)
    print(" ".join(cmd), flush=True)
    if dry:
        _write(out, dict(kind="check", shape=shape, backend=backend, gpus=gpus, command=cmd, **check(backend, gpus, cmd)))
        return
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=cuda or ",".join(str(i) for i in range(gpus)))
    t0 = time.time()
    with GpuMemoryPeak(env["CUDA_VISIBLE_DEVICES"]) as memory:
        rc, errors = run_watching_stderr(cmd, env, timeout)
    mode = {} if backend != "verl" else {
        "vllm_mode": "eager" if str(verl["actor_rollout_ref.rollout.enforce_eager"]).lower() == "true" else "cuda graphs"}
    db = run_dir / name / "run.db"
    untimed = {profile_step} if profile_step is not None else set()  # the profiler's cost is not the row's
    summary = steps_summary(db, untimed)
    if "error" not in summary:
        try:
            summary |= easyr1_figures(db, model_dir, gpus, card(), untimed)
        except Exception as e:  # noqa: BLE001 - the timings stand without them
            summary["easyr1_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    result = dict(kind="train", shape=shape, backend=backend, gpus=gpus, card=card(), **provenance(), rc=rc,
                  wall_s=time.time() - t0, **mode, steps=steps, overrides=extra, weights="random", model=str(model_dir),
                  peak_gpu_memory_gb=max(memory.peak_gb.values()) if memory.peak_gb else None,
                  peak_gpu_memory_gb_by_card=memory.peak_gb, **summary, **({"failure": errors} if rc != 0 else {}))
    _write(out, result)  # the row stands before its trace is read: a large trace takes minutes
    if traces is not None:  # what the GPU did in the profiled window, from the trace rank 0 wrote
        files = sorted(traces.rglob("*.json.gz"))
        try:
            result["profile"] = trace_summary.summarize_files(files) if files else f"no trace under {traces}"
        except Exception as e:  # noqa: BLE001 - the row's figures stand without it
            result["profile"] = f"the trace under {traces} could not be read: {type(e).__name__}: {str(e)[:300]}"
        _write(out, result)


def easyr1_figures(db: Path, model_dir: Path, gpus: int, card_name: str, untimed: set[int] = frozenset()) -> dict:
    """Throughput and actor MFU as EasyR1 defines them (bapo_vl/perf.py), medians over steps 2.. less `untimed` (a
    profiled step): tokens/s per GPU = the step's prompt + response tokens / (step seconds x GPUs); MFU of the
    update (t_train; on verl its update_actor call, t_train_actor, which holds FSDP's offload moves but not the
    batch building or the engine's sleep) over the trained sequences. Prompt lengths are the fresh prompts' as the
    model's processor encodes them (the record keeps uids, not lengths); responses are taken at the step's mean
    length, so the attention term, a sum of squares, is a lower bound and the MFU with it."""
    from bapo_vl.backends.embedded import PromptEncoder
    from bapo_vl.config import Config
    from bapo_vl.perf import actor_mfu, peak_flops
    from bapo_vl.record import FRESH, query_ro, sql_in
    from bapo_vl.train import load_problems
    from transformers import AutoConfig

    run_dir = db.parent
    cfg = Config.from_dict(json.loads(query_ro(run_dir, "SELECT json FROM config")[0]["json"]))
    steps = [(r["step"], r["time"], json.loads(r["metrics"]))
             for r in query_ro(run_dir, "SELECT step, time, metrics FROM steps ORDER BY step")]
    fresh = {}
    for r in query_ro(run_dir, f"SELECT step, uid, G FROM prompt_steps WHERE {sql_in(FRESH)}"):
        fresh.setdefault(r["step"], []).append((r["uid"], r["G"]))
    _, problems = load_problems(cfg.run)
    by_uid = {p.uid: p for p in problems}
    encoder = PromptEncoder(str(model_dir), cfg.sampling)
    length = {}
    model_cfg = AutoConfig.from_pretrained(model_dir)
    peak = peak_flops(card_name)
    per_gpu, mfu, prompt_tokens = [], [], []
    for (_, t0, _), (step, t1, m) in zip(steps, steps[1:]):
        if step in untimed:
            continue
        seqs = []
        for uid, G in fresh.get(step, []):
            if uid not in length:
                length[uid] = len(encoder(by_uid[uid])["input_ids"])
            seqs += [length[uid]] * G
        prompts = sum(seqs)
        tokens = prompts + m["rollouts"] * m["response_length"]
        prompt_tokens.append(prompts)
        per_gpu.append(tokens / ((t1 - t0) * gpus))
        update_s = m.get("t_train_actor", m["t_train"])  # verl: its update_actor call, as EasyR1 times the update
        value = actor_mfu(model_cfg, [s + round(m["response_length"]) for s in seqs], update_s, gpus, peak)
        if value is not None:
            mfu.append(value)
    return dict(prompt_tokens=statistics.median(prompt_tokens), tokens_per_gpu_s=statistics.median(per_gpu),
                actor_mfu=statistics.median(mfu) if mfu else None, peak_flops=peak)


def steps_summary(db: Path, untimed: set[int] = frozenset()) -> dict:
    """Medians over steps 2.. (less `untimed`, a profiled step) of the record's time split and throughput; which
    steps they are: `timed_steps`; the record's GPU memory by phase, the most of any step."""
    if not db.exists():
        return {"error": f"no run record at {db}"}
    from bapo_vl.record import query_ro

    rows = [(r["step"], r["time"], json.loads(r["metrics"]))
            for r in query_ro(db.parent, "SELECT step, time, metrics FROM steps ORDER BY step")]
    # GPU memory: the most of any step, the first included (what the card must hold, not a rate)
    memory = {k[len("gpu_memory_"):-len("_gb")]: max(m.get(k, 0.0) for _, _, m in rows)
              for k in (rows[0][2] if rows else {}) if k.startswith("gpu_memory_")} or None
    timed = [i for i in range(1, len(rows)) if rows[i][0] not in untimed]
    if not timed:
        untimed_note = f", none timed (untimed: {sorted(untimed)})" if rows[1:] else ""
        return {"error": f"{len(rows)} steps recorded{untimed_note}", "gpu_memory_gb": memory}
    walls = [rows[i][1] - rows[i - 1][1] for i in timed]
    later = [rows[i][2] for i in timed]
    med = lambda key: statistics.median(m.get(key) or 0.0 for m in later)
    split = lambda key: med(key) if all(key in m for m in later) else None  # records since generate's split
    tokens = [m["rollouts"] * m["response_length"] for m in later]
    return dict(steps_recorded=len(rows), timed_steps=[rows[i][0] for i in timed], step_s=statistics.median(walls),
                generate_s=med("t_generate"),
                generate_engine_s=split("t_generate_sample"), generate_logprobs_s=split("t_generate_logprobs"),
                verify_s=med("t_verify"), train_s=med("t_train"), sync_s=med("t_sync"),
                # verl: where t_train went (its batch, the engine's sleep, log-prob passes, update_actor)
                train_parts_s={k[len("t_train_"):]: split(k) for k in later[0] if k.startswith("t_train_")} or None,
                response_length=med("response_length"), rollouts=med("rollouts"),
                generate_tokens_per_s=statistics.median(t / m["t_generate"] for t, m in zip(tokens, later)),
                train_tokens_per_s=statistics.median([t / m["t_train"] for t, m in zip(tokens, later) if m["t_train"]]
                                                     or [None]),  # None: no step trained
                loss=later[-1].get("loss"), grad_norm=later[-1].get("grad_norm"), gpu_memory_gb=memory)


def provenance() -> dict:
    """When, and from which commit of this checkout (None outside git)."""
    from bapo_vl.provenance import commit

    return dict(date=time.strftime("%Y-%m-%d", time.gmtime()), commit=commit())


def label(r: dict) -> str:
    engine = next((o.split("=", 1)[1] for o in r.get("overrides") or [] if o.startswith("rollout_engine=")), None)
    return (f"embedded ({engine or 'default'} engine)" if r["backend"] == "embedded"
            else f"verl, {r['gpus']} GPU{'s' if r['gpus'] > 1 else ''}")


def summary(result: dict, baseline: dict | None) -> dict:
    """One row of a benchmarks/ table: the result's figures as EasyR1 reports them and its tokens/s per GPU over the
    baseline's, measured by the same command (verl N GPUs over verl 1 GPU: the scaling efficiency; the embedded vLLM
    engine over the transformers engine: its speed-up). A failed run, or a baseline of another card or shape, gives
    no ratio."""
    keys = ("step_s", "generate_s", "verify_s", "train_s", "train_parts_s", "sync_s", "rollouts", "response_length",
            "prompt_tokens", "tokens_per_gpu_s", "actor_mfu", "peak_flops", "peak_gpu_memory_gb", "steps_recorded",
            "error", "easyr1_error", "failure")
    row = dict(kind="summary", row=label(result), shape=result["shape"], card=result["card"],
               date=result.get("date"), commit=result.get("commit"), weights=result.get("weights"), rc=result["rc"],
               gpus=result["gpus"], overrides=result.get("overrides") or [],
               **{k: result[k] for k in keys if k in result})
    if baseline is not None:
        row["baseline"] = dict(row=label(baseline), card=baseline["card"], rc=baseline["rc"],
                               **{k: baseline.get(k) for k in ("gpus", "tokens_per_gpu_s", "step_s")})
        same = (card_model(result), result["shape"]) == (card_model(baseline), baseline["shape"])
        ok = same and result.get("tokens_per_gpu_s") and baseline.get("tokens_per_gpu_s")
        row["tokens_per_gpu_s_x_baseline"] = result["tokens_per_gpu_s"] / baseline["tokens_per_gpu_s"] if ok else None
    return row


def _write(out: Path, result: dict):
    print(json.dumps(result), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def card_model(row: dict) -> str:
    """The card's model: rows compare across the runs of one machine, whichever of its cards each could see (the
    files given to `report` should come from one machine: one folder of docs/bench)."""
    return row["card"].split(" x ", 1)[-1]


def settings(row: dict) -> list[str]:
    """The overrides that change the work of a step (the rollout engine, micro-batching, verl's own settings and the
    "env ..." switches recorded in older files change only how it is done)."""
    return [o for o in row.get("overrides") or [] if not o.startswith(("rollout_engine=", "micro_batch_size=", "verl.", "env "))]


def report(files: list[Path]):
    results = [r for r in (json.loads(f.read_text()) for f in files) if r["kind"] in ("train", "bound")]
    for shape in SHAPES:
        rows = sorted((r for r in results if r["shape"] == shape and r["kind"] == "train"),
                      key=lambda r: (r["backend"] != "embedded", r["gpus"], sorted(r.get("overrides") or [])))
        b = next((r for r in results if r["shape"] == shape and r["kind"] == "bound"), None)
        if not rows:
            continue
        base = next((r for r in rows if r["backend"] == "embedded" and "step_s" in r
                     and not any(o.startswith("rollout_engine=") for o in r.get("overrides") or [])), None)
        print(f"\n## {shape}" + (f" (decode bound {b['tokens_per_s']:,.0f} tokens/s = {b['decode_step_ms']:.2f} ms "
                                  f"per step at {b['copy_rate_GBps']:.0f} GB/s, {b['card']})" if b else ""))
        print("| backend | card | changed settings | step s | generate / verify / train / sync s "
              "| of generate: engine / log-probs s | response tokens | generate tok/s | step x embedded | of bound "
              "| train tok/s | GPU GB: generate / update (nvidia-smi) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            engine = next((o.split("=", 1)[1] for o in r.get("overrides") or [] if o.startswith("rollout_engine=")), None)
            label = (f"embedded ({engine} engine)" if engine else "embedded") if r["backend"] == "embedded" \
                else f"verl, {r['gpus']} GPU, vLLM {r.get('vllm_mode', 'eager')}"
            changed = " ".join(r.get("overrides") or []) or "-"
            if "step_s" not in r:
                print(f"| {label} | {card_model(r)} | {changed} | failed: rc={r['rc']} {r.get('error', '')} "
                      f"| | | | | | | | {gpu_memory(r)} |")
                continue
            comparable = base and (card_model(base), settings(base)) == (card_model(r), settings(r))
            ratio = f"{base['step_s'] / r['step_s']:.2f}x" if comparable else "- (other card or settings)"
            frac = f"{r['generate_tokens_per_s'] / b['tokens_per_s']:.1%}" if b and card_model(b) == card_model(r) else "-"
            where = " / ".join("-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("generate_engine_s", "generate_logprobs_s"))
            verify = r["verify_s"] if "verify_s" in r else r["score_s"]  # results written before t_score's rename
            print(f"| {label} | {card_model(r)} | {changed} | {r['step_s']:.2f} | {r['generate_s']:.2f} / {verify:.2f} / "
                  f"{r['train_s']:.2f} / {r['sync_s']:.2f} | {where} | {r['rollouts']:.0f} x {r['response_length']:.0f} | "
                  f"{r['generate_tokens_per_s']:,.0f} | {ratio} | {frac} | {tokens_per_s(r['train_tokens_per_s'])} "
                  f"| {gpu_memory(r)} |")


def tokens_per_s(value) -> str:
    return "-" if value is None else f"{value:,.0f}"  # None: no step trained


def gpu_memory(r: dict) -> str:
    """A row's GPU memory: the record's most of a step, generate / update, and nvidia-smi's peak over the run."""
    record = r.get("gpu_memory_gb") or {}
    phases = " / ".join("-" if record.get(k) is None else f"{record[k]:.1f}" for k in ("generate", "train"))
    peak = r.get("peak_gpu_memory_gb")
    return f"{phases} ({'-' if peak is None else f'{peak:.1f}'})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("models")
    m.add_argument("out", type=Path)
    m.add_argument("--shapes", nargs="+", choices=MODELS, help="only these (default: all)")
    b = sub.add_parser("bound")
    t = sub.add_parser("train")
    for p in (b, t):
        p.add_argument("--shape", choices=SHAPES, required=True)
        p.add_argument("--model", type=Path, required=True)
        p.add_argument("--out", type=Path, required=True)
    t.add_argument("--backend", choices=["embedded", "verl"], required=True)
    t.add_argument("--gpus", type=int, default=1)
    t.add_argument("--steps", type=int, default=4)
    t.add_argument("--source", help="Geometry3K data folder (vl, vl3b shapes)")
    t.add_argument("--run-dir", type=Path, default=Path("/tmp/bench-runs"))
    t.add_argument("--timeout", type=float, default=500)
    t.add_argument("--set", nargs="*", default=[], help="more Config fields, KEY=VALUE (e.g. device=cpu); "
                   "verl.KEY=VALUE: a verl config override (--backend verl)")
    t.add_argument("--cuda", help="CUDA_VISIBLE_DEVICES for the run (default: the first --gpus cards)")
    t.add_argument("--keep-weights", action="store_true", help="write a checkpoint and final/ at the run's end "
                   "(save_every=0; default: none, save_every=-1; the run record is always kept)")
    t.add_argument("--profile-step", type=int, help="verl: run the actor's passes of this step under verl's torch "
                   "profiler (the update's first mini-batch) and put the trace's summary in --out; the step is "
                   "left out of the medians")
    t.add_argument("--check", action="store_true", help="compose and check the run's config (verl's too), write "
                   "it to --out and exit: runs nothing, needs no GPU")
    sub.add_parser("report").add_argument("files", type=Path, nargs="+")
    s = sub.add_parser("summary")
    s.add_argument("result", type=Path)
    s.add_argument("--baseline", type=Path, help="a result of the same command to take the ratio against")
    a = ap.parse_args()
    if a.cmd == "models":
        models(a.out, a.shapes)
    elif a.cmd == "summary":
        print(json.dumps(summary(json.loads(a.result.read_text()),
                                 json.loads(a.baseline.read_text()) if a.baseline else None), indent=1))
    elif a.cmd == "bound":
        bound(a.shape, a.model, a.out)
    elif a.cmd == "train":
        train(a.shape, a.backend, a.gpus, a.model, a.steps, a.out, a.source, a.run_dir, a.timeout, a.set, a.cuda,
              a.keep_weights, a.check, a.profile_step)
    else:
        report(a.files)


if __name__ == "__main__":
    main()
