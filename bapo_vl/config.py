"""The one config object. Every default is declared here, once; presets (YAML) and `key=value` overrides
change fields by name. Paper defaults are SPEC section 4; fields marked [code] follow the authors' code.

Config is a few groups of settings (run, sampling, bapo, optim, loss, and each backend's options), so that each
part of the code is handed the group it reads. Outside Python the names stay flat: key=value, presets and run
records name a field by its key (FIELDS), unique across groups; Config.from_dict and to_dict convert."""
from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import importlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from bapo_vl.algorithm import ONLINE_FILTERS, PROMOTE_RULES
from bapo_vl.fields import Range, within
from bapo_vl.loss_config import LossConfig
from bapo_vl.optim import LR_SCHEDULES
from bapo_vl.record import DB_NAME, SINKS, query_ro, read_meta
from bapo_vl.registry import Registry

PRESET_DIR = Path(__file__).parent / "presets"


def shorten(value, limit: int = 60) -> str:
    """A value as an error message shows it: its repr, cut with its length said when it is long (a pasted file
    is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(str(value)):,} characters)"


def one_line(e: BaseException, with_type: bool = False) -> str:
    """The error as one line: a KeyError's message unquoted, line breaks joined; `with_type` names its class."""
    text = e.args[0] if type(e) is KeyError and len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return f"{type(e).__name__}: {text}" if with_type else text


class ConfigError(ValueError):
    """A config value that is refused; the message names the key (and the file it came from) and what it takes."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class UnknownKey(ConfigError, KeyError):
    """A key that is no Config field (a KeyError for lookups, a ConfigError for the command line)."""

    def __str__(self):
        return str(self.args[0])  # KeyError would quote the message


DEVICES = ("auto", "cpu", "cuda")
ROLLOUT_ENGINES = ("auto", "transformers", "vllm")  # bapo_vl/backends/engines.py
DTYPES = ("auto", "float32", "bfloat16")  # the embedded backend computes in bf16 (autocast) or fp32
MIXED_PRECISION = ("autocast", "compute_copy")

# The baselines are presets of the same trainer (SPEC section 3), applied on top of the task preset.
ALGOS: dict[str, dict[str, Any]] = {
    "bapo": {},
    "grpo": dict(delay=1, online_filter="none", use_x2=False, use_x3=False),
    "grpo_v5": dict(delay=5, online_filter="none", use_x2=False, use_x3=False),
    "dapo": dict(delay=1, online_filter="range", use_x2=False, use_x3=False, clip_low=0.2, clip_high=0.28,
                 loss_agg="token-mean", dynamic_sampling_rounds=4),
    "bapo_no_x2": dict(use_x2=False),
    "bapo_no_x3": dict(use_x3=False),
    # Parameter-free "mini-test" (paper section 5.2): X1 drops all-0/all-1 groups; X2 takes the all-wrong
    # groups (mu == 0), re-generated every step (stored all-wrong responses have zero advantage); X3 reuses
    # groups with mu == 1/2 exactly. It is a preset: c1 = 0 and c2 = c3 = 1/2 express it.
    "ba_ppo": dict(critic=True),  # BA-PPO: BAPO's batch adaptation in front of PPO with a critic (A.9)
    "mini_test": dict(online_filter="range", c1=0.0, c2_range=(0.5, 0.5), c3_range=(0.5, 0.5), reeval_every=1),
    # In the manner of TRL's GRPOWithReplayBuffer: on-policy GRPO whose zero-variance groups are replaced by mixed
    # groups trained on before (a buffer of 64; TRL keeps the highest-scored, this keeps the newest), no re-evaluation.
    "grpo_replay": dict(delay=1, online_filter="range", use_x2=False, use_x3=True, high_max_age=1_000_000,
                        high_max_uids=64, c2_range=(1 / 8, 1 / 8), c3_range=(7 / 8, 7 / 8)),
}


# --- backends: what runs the steps ---------------------------------------------------------------------------
# name -> the dataclass of the fields only that backend reads (its options: Config's group of that name), with
# LAUNCH, the function that runs a training run on it ("module:function", imported when a run starts: this module
# imports no torch), and INSTEAD, what the other backend takes in place of each field (the line that refuses it there).
BACKENDS: Registry[type] = Registry("backend")


@BACKENDS.register("embedded")
@dataclass
class EmbeddedOptions:
    """options of the embedded backend (backend=embedded)

    bapo_vl/backends/embedded.py: one process, CPU or one CUDA GPU, transformers models; `bapo train` runs it
    in-process (bapo_vl.train.train)."""
    LAUNCH: ClassVar[str] = "bapo_vl.train:train"
    INSTEAD: ClassVar[dict[str, str]] = {
        "rollout_engine": "verl samples with its own engine: verl.actor_rollout_ref.rollout.name",
        "vllm_options": "set verl's vLLM through verl.actor_rollout_ref.rollout.* (e.g. gpu_memory_utilization)",
        "generate_batch_size": ("verl's engine batches the rollouts itself "
                                "(verl.actor_rollout_ref.rollout.max_num_seqs)"),
        "score_batch_size": "use verl.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "micro_batch_size": "use verl.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "dtype": "verl computes in bf16 under FSDP's mixed precision (verl.actor_rollout_ref.actor.fsdp_config)",
        "mixed_precision": ("verl's FSDP actor keeps fp32 weights and computes in bf16 "
                            "(verl.actor_rollout_ref.actor.fsdp_config.mixed_precision)"),
        "compile": "verl compiles what its actor's config says (verl.actor_rollout_ref.actor.use_torch_compile)",
        "gradient_checkpointing": "use verl.actor_rollout_ref.model.enable_gradient_checkpointing",
    }

    rollout_engine: str = within("auto", ROLLOUT_ENGINES)
    """what samples rollouts: auto (vllm for a text model on cuda when it is installed, else transformers) |
    transformers | vllm (the [vllm] extra)"""
    vllm_options: dict = field(default_factory=dict)
    """keyword arguments of vLLM's LLM(...) for the vllm engine, over its defaults {gpu_memory_utilization: 0.3,
    max_num_seqs: 1024, enable_sleep_mode: true}: e.g. {gpu_memory_utilization: 0.5, enforce_eager: true}. Unless
    gpu_memory_utilization or kv_cache_memory_bytes is given, the KV cache holds max_num_seqs sequences of full
    length where those fit in the default share (no start-up memory profile, which fails when other processes on the
    card allocate meanwhile). enable_sleep_mode: false keeps the engine's memory through the update, for runs that
    share a card"""
    generate_batch_size: int = within(256, Range(ge=1))
    """sequences per generate call (the transformers engine)"""
    score_batch_size: int = within(32, Range(ge=1))
    """sequences per forward when scoring log-probs without gradients (behaviour, proximal, reference): larger than
    micro_batch_size, which is sized for the update's activations"""
    micro_batch_size: int = within(16, Range(ge=1))
    """sequences per forward/backward (gradient accumulation inside a mini-batch), grouped by length, except for
    balanced_clip, whose bounds are taken per micro-batch"""
    dtype: str = within("auto", DTYPES)
    """auto (bf16 autocast on GPU, fp32 on CPU) | float32 | bfloat16"""
    mixed_precision: str = within("autocast", MIXED_PRECISION)
    """how the update computes in bf16 (dtype auto on GPU, or bfloat16): autocast (fp32 weights cast in every
    forward) | compute_copy (a bf16 copy runs forward and backward, gradients accumulate into the fp32 weights the
    optimizer steps, the copy is refreshed once per optimizer step: bapo_vl/backends/mixed_precision.py)"""
    compile: bool = False
    """torch.compile each repeated block (decoder layers, vision blocks) of the model the update runs on, and the LM
    head's work per chunk of logits: the norms, rotary embeddings and activations around each matmul, and the
    softmax passes over the vocabulary, fuse into fewer kernels. One compiled block serves every layer, for dynamic
    shapes (lengths change from step to step); the first updates wait for the compiler. Sampling with the
    transformers engine stays eager"""
    gradient_checkpointing: bool = False
    """recompute each repeated block's activations in the backward instead of keeping them from the forward: a
    micro-batch then holds one block's activations, not every layer's, for about a third more update compute: for
    updates whose activations do not fit the card, or longer micro-batches"""


@BACKENDS.register("verl")
@dataclass
class VerlOptions:
    """options of the verl backend (backend=verl)

    bapo_vl/backends/verl_backend.py: verl 0.9.1's Ray workers, FSDP actor and vLLM engine, driven by the same
    trainer, on one or more GPUs and nodes; started by bapo_vl.verl_launch.launch."""
    LAUNCH: ClassVar[str] = "bapo_vl.verl_launch:launch"
    INSTEAD: ClassVar[dict[str, str]] = {
        "verl": "verl.* keys set verl's own config: add backend=verl (the verl_* presets set it), or drop them"}

    overrides: dict = field(default_factory=dict, metadata={"dotted": True, "key": "verl"})
    """overrides of verl's ppo_trainer config, dotted keys, for how verl runs the steps (parallelism, memory,
    engine), e.g. {trainer.n_gpus_per_node: 8, actor_rollout_ref.rollout.gpu_memory_utilization: 0.4}. One key on the
    command line: verl.trainer.nnodes=2, its value as verl's (Hydra's) overrides read it. Each layer (preset,
    --config, command line) adds to the keys of those below it. A key our fields decide (model, lr, loss, lengths,
    batch size, sampling: verl_launch.derived_settings) is refused, naming the field to set instead"""


# --- the groups of Config beside the backends' options --------------------------------------------------------------

@dataclass
class RunSettings:
    """what is trained and where its run is written"""
    task: str = "countdown"
    """task plugin name (`bapo tasks` lists them)"""
    task_options: dict = field(default_factory=dict)
    """passed to the task's load(), e.g. {template: compact, source: path/to/train.parquet}"""
    tasks_dirs: list[str] = field(default_factory=list)
    """extra folders searched for task plugins"""
    model: str = "countdown-tiny"
    """hub id, local path, or the name of a policy bundled in bapo_vl/policy/ (the tiny countdown policy)"""
    run_dir: str = "runs"
    """runs are written to run_dir/name"""
    name: str | None = None
    """run name, a plain folder name (no / or \\, at most 255 bytes); default: <algo>-<task>-<timestamp>"""
    resume: str | None = None
    """a run directory to continue from its latest complete checkpoint, with the config recorded there (only steps,
    max_rollouts, save_every, keep_checkpoints, log_samples, report_to, verl, device, run_dir may change; the record
    keeps the changes but device and run_dir, so a later resume goes on with them); a run stopped before its first
    checkpoint starts again from step 0"""
    seed: int = 42
    """seeds data order, sampling and BAPO's random choices"""
    steps: int = within(100, Range(ge=1))
    """training steps T"""
    max_rollouts: int = within(0, Range(ge=0), "0 = no rollout budget")
    """rollout budget: stop after the first step at which the responses generated so far (fresh and re-evaluation
    alike, the steps' `rollouts`) reach it, so a run overshoots by less than one step; 0 = no limit (steps caps)"""
    device: str = within("auto", DEVICES)
    """auto | cpu | cuda"""
    backend: str = within("embedded", BACKENDS)
    """what runs the steps: embedded (one process, CPU or one GPU) | verl (Ray + FSDP + vLLM, one or more GPUs and
    nodes: pip install -e ".[verl]"; the verl_* presets set it). Each reads its own group of fields (embedded,
    verl) and refuses the other's, naming what it takes instead"""
    algo: str = within("bapo", ALGOS)
    """a preset of bapo, optim and loss fields (ALGOS): bapo | grpo | grpo_v5 | dapo | bapo_no_x2 | bapo_no_x3 |
    ba_ppo | mini_test | grpo_replay"""
    log_samples: int = within(4, Range(ge=0))
    """responses kept per step in the run record"""
    save_every: int = within(0, Range(ge=-1))
    """checkpoint every N steps (0: only at the end; -1: never, and no final model: runs only timed, as
    benchmarks are)"""
    keep_checkpoints: int = within(2, Range(ge=0), "0 = keep all")
    """checkpoints kept: the newest N; an older one is removed once a newer one is written whole. 2 leaves one to
    fall back to if the newest is damaged; 0 = keep all"""
    report_to: list[str] = within([], SINKS)
    """extra scalar sinks: tensorboard, wandb"""


@dataclass
class SamplingSettings:
    """the rollouts: how many, and how they are sampled"""
    batch_size: int = within(256, Range(ge=1))
    """B: prompts sampled per step, also the training batch capacity and B_bad's capacity"""
    group_size: int = within(8, Range(ge=2), "GRPO needs a group; e.g. group_size=8")
    """G: responses per prompt"""
    temperature: float = within(1.0, Range(gt=0))
    """sampling temperature of rollouts (behaviour log-probs are taken at it)"""
    top_p: float = within(1.0, Range(gt=0, le=1))
    """nucleus sampling: 1.0 samples from the whole distribution"""
    top_k: int = within(-1, Range(ge=-1))
    """-1: no top-k cut"""
    max_prompt_length: int = within(2048, Range(ge=1))
    """tokens, images included; a longer prompt is an error"""
    max_response_length: int = within(8192, Range(ge=1))
    """tokens generated per response at most"""
    min_pixels: int = within(3136, Range(ge=1))
    """the processor resizes each image to between min_pixels and max_pixels pixels"""
    max_pixels: int = within(1003520, Range(ge=1))
    """see min_pixels"""


@dataclass
class BapoSettings:
    """BAPO's batch adaptation (the trainer's, bapo_vl/trainer.py)"""
    delay: int = within(5, Range(ge=1), "delay=1 is on-policy")
    """v: the rollout policy is synchronised with the trainer every v steps (v=1: on-policy)"""
    online_filter: str = within("range", ONLINE_FILTERS)
    """X1 filter (algorithm.ONLINE_FILTERS): range (keep 1/G <= mu <= (G-1)/G) | gaussian | uniform | none"""
    gaussian_mean: float = within(0.5, Range(ge=0, le=1))
    """gaussian filter: keep a group with probability exp(-(mu - mean)^2 / (2 std^2))"""
    gaussian_std: float = within(0.2, Range(gt=0))
    """gaussian filter: its width"""
    uniform_keep: float = within(0.6, Range(ge=0, le=1))
    """uniform filter: the fraction of groups kept"""
    use_x2: bool = True
    """re-evaluate B_bad and promote improved prompts (X2)"""
    reeval_every: int = within(5, Range(ge=1))
    """m: re-evaluation frequency in steps"""
    reeval_max: int = within(128, Range(ge=1))
    """at most this many B_bad prompts are re-evaluated"""
    promote: str = within("threshold", PROMOTE_RULES)
    """X2 rule (algorithm.PROMOTE_RULES): threshold (c1 < mu_new < 1, paper) | improved (mu_new > mu_old, [code])"""
    use_x3: bool = True
    """replay high-quality groups from B_high (X3)"""
    high_max_age: int = within(3, Range(ge=1))
    """B_high keeps groups of the most recent steps only"""
    high_max_uids: int | None = within(None, Range(ge=1))
    """[code] caps B_high at 8 uids; None = uncapped (paper)"""
    c1: float = within(1 / 8, Range(ge=0, lt=1))
    """fresh groups with mu <= c1 go to B_bad (the X2 source)"""
    c2_range: tuple[float, float] = within((1 / 8, 4 / 8), Range(ge=0, le=1))
    """[low, high] of c2, the lower bound of mu for B_high: c2 = low + r_tot * (high - low) (eq. 8)"""
    c3_range: tuple[float, float] = within((2 / 8, 5 / 8), Range(ge=0, le=1))
    """[low, high] of c3, the upper bound of mu for B_high (eq. 8)"""
    dynamic_sampling_rounds: int = within(0, Range(ge=0))
    """DAPO: generate until B groups with 0 < mu < 1, at most this many rounds (0 = off)"""


@dataclass
class OptimSettings:
    """the policy update: optimizer, schedule, advantages, critic"""
    lr: float = within(1e-6, Range(gt=0))
    """peak learning rate of the policy (AdamW)"""
    lr_schedule: str = within("constant", LR_SCHEDULES)
    """after the warm-up: constant | linear | cosine decay to min_lr_ratio x lr at the last step (`steps`)"""
    lr_warmup_steps: int = within(0, Range(ge=0))
    """training steps of linear warm-up (step t of W trains at lr x t / W)"""
    min_lr_ratio: float = within(0.0, Range(ge=0, le=1))
    """where linear and cosine decay end, as a fraction of lr"""
    weight_decay: float = within(0.0, Range(ge=0))
    """AdamW's decoupled weight decay"""
    grad_clip: float = within(1.0, Range(gt=0))
    """the gradient's global norm is clipped to this before each optimizer step"""
    epochs: int = within(1, Range(ge=1))
    """passes over each training batch (ppo_epochs)"""
    mini_batch_size: int = within(64, Range(ge=1))
    """prompts (groups) per optimizer step at most: a batch of n groups takes ceil(n / mini_batch_size) optimizer
    steps on near-equal shares (bapo_vl.optim.mini_batches; verl trains on whole mini-batches only)"""
    tis_threshold: float | None = within(None, Range(gt=0))
    """[code] token-level truncated importance sampling threshold (3 in the authors' code); None = off"""
    adv_eps: float = within(1e-6, Range(gt=0))
    """ε of the GRPO advantage (r - mean) / sqrt(std^2 + ε)"""
    critic: bool = False
    """BA-PPO (paper A.9): a learned critic and GAE (gamma = lam = 1) instead of GRPO's group baseline"""
    critic_lr: float = within(1e-5, Range(gt=0))
    """critic: learning rate of the value model"""
    value_clip: float = within(0.5, Range(gt=0))
    """critic: clipped value loss, |V − V_old| <= value_clip"""


@dataclass
class Config:
    """Every field is checked on creation (check_fields): its type from the annotation, its range or names from
    `within`. So a preset, a --config file, `key=value` and Config in Python all meet the same checks. Which
    backend reads a field is checked where what was given is known (load_config, resume_config)."""
    run: RunSettings = field(default_factory=RunSettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    bapo: BapoSettings = field(default_factory=BapoSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    loss: LossConfig = field(default_factory=LossConfig)  # its fields and their docs are declared in loss_config
    embedded: EmbeddedOptions = field(default_factory=EmbeddedOptions)  # a group per backend, named as in BACKENDS
    verl: VerlOptions = field(default_factory=VerlOptions)

    def __post_init__(self):
        check_fields(self)
        check_run_name(self.run.name)
        if self.sampling.min_pixels > self.sampling.max_pixels:
            raise ConfigError(f"min_pixels={self.sampling.min_pixels} is above max_pixels={self.sampling.max_pixels}",
                              "min_pixels")

    @classmethod
    def from_dict(cls, values: dict) -> Config:
        """The Config of flat {key: value} (FIELDS' keys, as key=value, presets and run records name the fields);
        the fields not given keep their defaults."""
        for key in values:
            if key not in FIELDS:
                raise unknown_key(str(key))
        # converted before the groups are built: LossConfig checks its values as it is created
        values = {key: check_field(FIELDS[key], values[key]) for key in checking_order(values)}
        groups = {}
        for group, settings in GROUPS.items():
            given = {f.name: values[key_of(f)] for f in fields_of(settings) if key_of(f) in values}
            try:
                groups[group] = settings(**given)
            except ValueError as e:  # LossConfig's own checks (dual_clip > 1, ...)
                raise ConfigError(str(e).replace("LossConfig.", "")) from None
        return cls(**groups)

    def to_dict(self) -> dict:
        """{key: value} of every field, flat: the form from_dict reads and run records keep."""
        return {key: copy.deepcopy(getattr(getattr(self, GROUP_OF[key]), f.name)) for key, f in FIELDS.items()}


def key_of(f: dataclasses.Field) -> str:
    """A field's key: its name in key=value, presets and run records (its attribute name unless it declares one)."""
    return f.metadata.get("key", f.name)


def fields_of(settings) -> list[dataclasses.Field]:
    """The config fields of a group (not LossConfig's bac_reduce, which is set where the loss runs)."""
    return [f for f in dataclasses.fields(settings) if f.metadata.get("setting", True)]


GROUPS = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # group -> its dataclass
FIELDS = {key_of(f): f for settings in GROUPS.values() for f in fields_of(settings)}
GROUP_OF = {key_of(f): group for group, settings in GROUPS.items() for f in fields_of(settings)}
BACKEND_OF = {key: group for key, group in GROUP_OF.items() if group in BACKENDS}  # a backend's options' keys
_keys = [key_of(f) for settings in GROUPS.values() for f in fields_of(settings)]
assert len(_keys) == len(FIELDS), f"a key names two fields: {sorted({k for k in _keys if _keys.count(k) > 1})}"
assert set(BACKENDS) <= set(GROUPS), "each backend's options are Config's group of the backend's name"


# --- field checks: the type from the annotation, the range or names from `within` --------------------------------

TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
              "dict": "a mapping {key: value, ...}", "list": "a list [a, b, ...]",
              "tuple": "a pair [low, high] with low <= high"}


def _int(x, items=()):
    if isinstance(x, bool):
        raise TypeError(x)
    if isinstance(x, int):
        return x
    number = float(x)  # "2", 2.0 and "1e3" are integers too
    if number != int(number):
        raise ValueError(x)
    return int(number)


def _float(x, items=()):
    if isinstance(x, bool):
        raise TypeError(x)
    return float(x)  # YAML reads 1e-6 (no dot) as the string "1e-6"


def _str(x, items=()):
    if isinstance(x, bool) or not isinstance(x, (str, int, float)):
        raise TypeError(x)
    return str(x)  # YAML reads name=2024 as a number


def _bool(x, items=()):
    if not isinstance(x, bool):
        raise TypeError(x)
    return x


def _dict(x, items=()):
    if not isinstance(x, dict):
        raise TypeError(x)
    return x


def _list(x, items):
    if not isinstance(x, (list, tuple)):
        raise TypeError(x)  # a string would be iterated character by character
    return [CONVERT[items[0]](v) for v in x]


def _pair(x, items):
    if not isinstance(x, (list, tuple)) or len(x) != len(items):
        raise TypeError(x)
    low, high = (CONVERT[kind](v) for kind, v in zip(items, x))
    if not low <= high:
        raise ValueError(x)
    return low, high


CONVERT = {"int": _int, "float": _float, "str": _str, "bool": _bool, "dict": _dict, "list": _list, "tuple": _pair}


def _annotation(f: dataclasses.Field) -> tuple[str, list[str], bool]:
    """(kind, item kinds, optional) of a field's annotation: "tuple[float, float] | None" -> tuple, [float, float],
    True."""
    optional = f.type.endswith(" | None")
    kind, _, items = f.type.removesuffix(" | None").partition("[")
    return kind, [i.strip() for i in items.rstrip("]").split(",") if i.strip()], optional


def check_field(f: dataclasses.Field, value):
    """`value` as field `f` takes it, or a ConfigError naming the key, the value and what the field takes."""
    kind, items, optional = _annotation(f)
    key = key_of(f)
    if value is None and optional:
        return None
    try:
        value = CONVERT[kind](value, items)
    except (TypeError, ValueError, OverflowError):
        example = f"; e.g. {key}=[{value}]" if kind == "list" and isinstance(value, str) else ""
        or_null = " or null" if optional else ""
        raise ConfigError(f"{key}={shorten(value)}: must be {TYPE_WORDS[kind]}{or_null}{example}", key) from None
    accepted, hint = f.metadata.get("accepted"), f.metadata.get("hint")
    each = isinstance(value, (list, tuple))
    if accepted is not None and not all(v in accepted for v in (value if each else [value])):
        what = (f"{'each must' if each else 'must'} be {accepted}" if isinstance(accepted, Range)
                else f"choose {'from' if each else 'one of'} {', '.join(accepted)}")
        raise ConfigError(f"{key}={value!r}: {what}" + (f" ({hint})" if hint else ""), key)
    return value


NAME_MAX = 255  # bytes in a folder name on Linux, macOS and Windows file systems


def check_run_name(name: str | None) -> None:
    """A run name is one folder under run_dir: a name that walked out of it (../x, /abs) or that no file system
    takes (too long, NUL) is refused here, with one line, rather than by the OS once the run is being written."""
    if not name:
        return
    shown = shorten(name)
    if "/" in name or "\\" in name or name in (".", ".."):
        raise ConfigError(f"name={shown}: a run name is a plain folder name, without / or \\ and not . or ..; choose "
                          "where runs go with run_dir=", "name")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ConfigError(f"name={shown}: a run name has no control characters", "name")
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX:
        raise ConfigError(f"name={shown}: a run name is a folder name, at most {NAME_MAX} bytes; choose a shorter "
                          "one", "name")


def checking_order(keys) -> list[str]:
    """Keys with the registry-named fields last: reading a registry may import what its entries need (policy losses:
    torch), so a mistake in any other field is reported before that wait."""
    return sorted(keys, key=lambda key: isinstance(FIELDS[key].metadata.get("accepted"), Registry))


def check_fields(cfg: Config) -> None:
    """Every field of cfg checked (and converted: YAML's "1e-6" to a float, a list to a pair) in place."""
    for key in checking_order(FIELDS):
        group, name = getattr(cfg, GROUP_OF[key]), FIELDS[key].name
        setattr(group, name, check_field(FIELDS[key], getattr(group, name)))


# --- field docs: the string literal after each field (an attribute docstring), read from the source ------------

@functools.cache
def _attribute_docs(cls) -> dict[str, str]:
    """{attribute: doc} of a dataclass: a field's doc is the string literal right after it."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {node.target.id: " ".join(inspect.cleandoc(after.value.value).split())
            for node, after in zip(body, [*body[1:], None])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


def field_docs() -> dict[str, str]:
    """{key: doc} of every field, read where its group declares it (the loss fields in LossConfig)."""
    return {key: _attribute_docs(GROUPS[GROUP_OF[key]]).get(f.name, "") for key, f in FIELDS.items()}


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def as_override(value) -> str:
    """A value as one types it after `key=` (YAML, which load_config parses)."""
    text = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True, width=10**6)
    return text.strip().removesuffix("...").strip()


def config_help() -> str:
    """Every Config field with its default and doc, a section per group (the epilog of `bapo train --help`)."""
    docs = field_docs()
    tiny = read_config_file(PRESET_DIR / "tiny.yaml")  # what a plain `bapo train` runs
    rows = [(GROUP_OF[key], f"{key}={as_override(field_default(f))}",
             (f"[tiny: {as_override(tiny[key])}] " if key in tiny else "") + docs[key]) for key, f in FIELDS.items()]
    width = min(max(len(key) for _, key, _ in rows), 32)
    out = ["config fields, key=value, with Config's defaults. A plain `bapo train` runs the tiny preset, which sets "
           "those marked [tiny: ...] (e.g. steps=60 batch_size=32); --preset picks another, algo= changes some more:"]
    section = None
    for group, key, doc in rows:
        if group != section:
            section = group
            out.append(f"\n{group}: {inspect.getdoc(GROUPS[group]).splitlines()[0]}")
        if len(key) > width and doc:
            key += "\n  " + " " * width  # too long for the column: the doc goes on the next line
        out.append(f"  {key:{width}s}  {doc}".rstrip())
    return "\n".join(out)


def unknown_key(key: str, where: str = "") -> UnknownKey:
    group, _, name = key.partition(".")
    close = difflib.get_close_matches(key, FIELDS, n=3)
    hint = (f"; keys are flat: {name}=" if group in GROUPS and name in FIELDS  # bapo.delay: what Python reads
            else f"; did you mean {' or '.join(close)}?" if close else "; `bapo train --help` lists them")
    return UnknownKey(f"{where}unknown config key {shorten(key)}{hint}", key)


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`key=value` strings -> (key, YAML value) pairs; unknown keys and items without `=` are refused. A field that
    takes dotted keys (verl) takes `field.dotted.key=text` too: the pair (field, {dotted.key: text}), the text as
    written, for the backend's own parser."""
    pairs = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value")
        name, _, entry = key.partition(".")
        if entry and name in FIELDS and FIELDS[name].metadata.get("dotted"):
            pairs.append((name, {entry: text}))
            continue
        if key not in FIELDS:
            raise unknown_key(key)
        try:
            pairs.append((key, yaml.safe_load(text)))
        except yaml.YAMLError as e:
            raise ConfigError(f"{shorten(item)}: the value is not valid YAML ({getattr(e, 'problem', None) or e}); "
                              f"quote it, e.g. {key}='...'", key) from None
        except ValueError:  # YAML reads a number of more than 4,300 digits with int(), which refuses it
            raise ConfigError(f"{key}={shorten(text)}: not a number any field takes; give a value as "
                              "`bapo train --help` lists for it", key) from None
    return pairs


def merge(values: dict, key: str, value) -> None:
    """values[key] = value, except that a field taking dotted keys (verl) adds the given keys to those it holds."""
    if FIELDS[key].metadata.get("dotted") and isinstance(value, dict) and isinstance(values.get(key), dict):
        value = {**values[key], **value}
    values[key] = value


def read_config_file(path: Path) -> dict:
    """The fields a preset or --config file sets, and `preset`, the preset it builds on, if it names one; the errors
    name the file (and the line). The verl launcher's older layout, the fields under `bapo:`, reads the same."""
    if not path.is_file():
        known = ", ".join(p.stem for p in sorted(PRESET_DIR.glob("*.yaml")))
        raise FileNotFoundError(f"config {path} not found (presets: {known})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    except ValueError:  # a number of more than 4,300 digits (see parse_overrides)
        raise ConfigError(f"{path}: holds a number too long to read; give each field a value "
                          "`bapo train --help` lists for it") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file holds `key: value` lines, not a {type(data).__name__}")
    nested = data.pop("bapo", None) or {}  # the verl launcher's older layout
    if not isinstance(nested, dict):
        raise ConfigError(f"{path}: bapo: holds `key: value` lines, not a {type(nested).__name__}")
    data.update(nested)
    for key in data:
        if key not in FIELDS and key != "preset":
            raise unknown_key(str(key), f"{path}: ")
    return data


def config_layers(path: Path) -> list[tuple[Path, dict]]:
    """(file, the fields it sets) for a config file and, first, the presets it builds on (`preset: NAME`)."""
    data = read_config_file(path)
    base = data.pop("preset", None)
    return [*(config_layers(PRESET_DIR / f"{base}.yaml") if base is not None else []), (path, data)]


def load_config(preset: str | None = None, file: str | None = None, overrides: list[str] = ()) -> Config:
    """Config from a preset name (presets/<name>.yaml), then a YAML file, then `key=value` overrides. Either file
    may build on a preset (`preset: NAME`, read before it); with no preset named, the tiny one is the base.
    `algo=...` expands to its preset fields before the other overrides, so `algo=dapo clip_high=0.3` works.
    A value refused from a file is reported with the file's path. A field only another backend reads is refused
    when given (an override, a --config file; check_backend_options), not when a bundled preset sets it."""
    named = config_layers(PRESET_DIR / f"{preset}.yaml") if preset else []
    own = config_layers(Path(file)) if file is not None else []
    names_base = named or len(own) > 1  # --preset, or the file's `preset:`
    layers = (config_layers(PRESET_DIR / "tiny.yaml") if not names_base else []) + named + own
    values: dict[str, Any] = {}
    origin: dict[str, Path] = {}  # the file each value came from (none: an override or an algo preset)
    for path, data in layers:
        for key, value in data.items():
            merge(values, key, value)
        origin.update(dict.fromkeys(data, path))
    given = {key for path, data in layers if path.resolve().parent != PRESET_DIR.resolve() for key in data}
    pairs = parse_overrides(overrides)
    algo = dict(pairs).get("algo", values.get("algo", "bapo"))
    if algo not in ALGOS:
        where = f"{origin['algo']}: " if "algo" in origin and "algo" not in dict(pairs) else ""
        raise ConfigError(f"{where}algo={algo!r}: choose one of {', '.join(ALGOS)}", "algo")
    values.update(ALGOS[algo], algo=algo)
    for key, value in pairs:
        merge(values, key, value)
    for key in [*ALGOS[algo], *dict(pairs)]:
        origin.pop(key, None)
    try:
        cfg = Config.from_dict(values)
        check_backend_options(cfg, given | set(dict(pairs)))
        return cfg
    except ConfigError as e:
        if e.key in origin:
            raise ConfigError(f"{origin[e.key]}: {e}", e.key) from None
        raise


def check_backend_options(cfg: Config, given) -> None:
    """A field of the keys `given` that only another backend reads is refused: one line naming what the run's backend
    takes instead."""
    backend = cfg.run.backend
    key = next((k for k in FIELDS if k in given and BACKEND_OF.get(k, backend) != backend), None)
    if key is not None:
        raise ConfigError(f"{key}={shorten(cfg.to_dict()[key])}: the {backend} backend does not use it; "
                          f"{BACKENDS[BACKEND_OF[key]].INSTEAD[key]}", key)


def launcher(backend: str):
    """The function that runs a training run on `backend` (its LAUNCH): launch(cfg, quiet=False) -> the run
    directory. Imported here, when a run starts."""
    module, _, name = BACKENDS.lookup(backend).LAUNCH.partition(":")
    return getattr(importlib.import_module(module), name)


# --- resume: the config a run recorded ---------------------------------------------------------------------------

def recorded_config(run_dir) -> dict:
    """The config a run was started with, as its record holds it (with the changes its resumes recorded); a record
    written before Config had `backend` has it from the record's meta."""
    if not (Path(run_dir) / DB_NAME).is_file():
        raise ConfigError(f"resume={run_dir}: no run record {Path(run_dir) / DB_NAME}; name the directory of a run "
                          "(`bapo runs --root DIR` lists them)", "resume")
    rows = query_ro(run_dir, "SELECT json FROM config")
    if not rows:
        raise ValueError(f"{Path(run_dir) / 'run.db'} holds no config: not a training run")
    return {"backend": read_meta(run_dir).get("backend", "embedded"), **json.loads(rows[0]["json"])}


def resume_config(run_dir, overrides: list[str] = ()) -> Config:
    """`bapo train resume=RUN_DIR [key=value ...]`: the run's recorded config with the (allowed) changes."""
    values, pairs = recorded_config(run_dir), parse_overrides(overrides)
    for key, value in pairs:
        merge(values, key, value)
    cfg = Config.from_dict({**values, "resume": str(run_dir)})
    check_backend_options(cfg, set(dict(pairs)))
    return cfg
