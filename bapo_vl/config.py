"""The one config object. Every default is declared here, once; presets (YAML) and `key=value` overrides
change fields by name. Paper defaults are SPEC section 4; fields marked [code] follow the authors' code."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bapo_vl.losses import LossConfig, get_policy_loss

PRESET_DIR = Path(__file__).parent / "presets"


@dataclass
class Config:
    # --- run ---
    task: str = "countdown"
    """task plugin name (`bapo tasks` lists them)"""
    task_options: dict = field(default_factory=dict)
    """passed to the task's load(), e.g. {template: compact, source: path/to/train.parquet}"""
    tasks_dirs: list = field(default_factory=list)
    """extra folders searched for task plugins"""
    model: str = "countdown-tiny"
    """hub id, local path, or the name of a policy bundled in bapo_vl/policy/ (the tiny countdown policy)"""
    run_dir: str = "runs"
    """runs are written to run_dir/name"""
    name: str | None = None
    """run name; default: <algo>-<task>-<timestamp>"""
    resume: str | None = None
    """a run directory to continue from its latest checkpoint (model, optimizer, buffers, data position)"""
    seed: int = 42
    steps: int = 100
    """training steps T"""
    device: str = "auto"
    """auto | cpu | cuda"""
    dtype: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16"""
    algo: str = "bapo"
    """preset of the fields below (ALGOS): bapo | grpo | grpo_v5 | dapo | bapo_no_x2 | bapo_no_x3 | ba_ppo | mini_test"""

    # --- sampling ---
    batch_size: int = 256
    """B: prompts sampled per step, also the training batch capacity and B_bad's capacity"""
    group_size: int = 8
    """G: responses per prompt"""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_prompt_length: int = 2048
    max_response_length: int = 8192
    generate_batch_size: int = 256
    """sequences per generate call"""

    # --- BAPO batch adaptation ---
    delay: int = 5
    """v: the rollout policy is synchronised with the trainer every v steps (v=1: on-policy)"""
    online_filter: str = "range"
    """X1 filter: range (keep 1/G <= mu <= (G-1)/G) | gaussian | uniform | none"""
    gaussian_mean: float = 0.5
    gaussian_std: float = 0.2
    uniform_keep: float = 0.6
    use_x2: bool = True
    """re-evaluate B_bad and promote improved prompts (X2)"""
    reeval_every: int = 5
    """m: re-evaluation frequency in steps"""
    reeval_max: int = 128
    """at most this many B_bad prompts are re-evaluated"""
    promote: str = "threshold"
    """X2 rule: threshold (c1 < mu_new < 1, paper) | improved (mu_new > mu_old, [code])"""
    use_x3: bool = True
    """replay high-quality groups from B_high (X3)"""
    high_max_age: int = 3
    """B_high keeps groups of the most recent steps only"""
    high_max_uids: int | None = None
    """[code] caps B_high at 8 uids; None = uncapped (paper)"""
    c1: float = 1 / 8
    c2_range: tuple = (1 / 8, 4 / 8)
    c3_range: tuple = (2 / 8, 5 / 8)
    dynamic_sampling_rounds: int = 0
    """DAPO: generate until B groups with 0 < mu < 1, at most this many rounds (0 = off)"""

    # --- optimisation ---
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 1
    """passes over each training batch (ppo_epochs)"""
    mini_batch_size: int = 64
    """prompts (groups) per optimizer step"""
    micro_batch_size: int = 16
    """sequences per forward/backward (gradient accumulation inside a mini-batch)"""
    # loss defaults are declared once, in losses.LossConfig (its docstrings say what each one does)
    loss: str = LossConfig.name
    """policy loss: ppo_clip | gspo | balanced_clip"""
    clip_low: float = LossConfig.clip_low
    clip_high: float = LossConfig.clip_high
    dual_clip: float | None = LossConfig.dual_clip
    loss_agg: str = LossConfig.agg
    """token-mean | seq-mean-token-mean | seq-mean-token-sum"""
    kl_coef: float = LossConfig.kl_coef
    entropy_coef: float = LossConfig.entropy_coef
    bac_clip_low_range: tuple = LossConfig.bac_clip_low_range
    bac_clip_high_range: tuple = LossConfig.bac_clip_high_range
    bac_target: float = LossConfig.bac_target
    bac_step: float = LossConfig.bac_step
    bac_dual_clip: float = LossConfig.bac_dual_clip
    """balanced_clip only: ranges of the ratio bounds, target positive share, step, dual clip"""
    critic: bool = False
    """BA-PPO (paper A.9): a learned critic and GAE (gamma = lam = 1) instead of GRPO's group baseline"""
    critic_lr: float = 1e-5
    value_clip: float = 0.5
    """critic: clipped value loss, |V − V_old| <= value_clip"""
    tis_threshold: float | None = None
    """[code] token-level truncated importance sampling threshold (3 in the authors' code); None = off"""
    adv_eps: float = 1e-6

    # --- images (vision-language models) ---
    min_pixels: int = 3136
    max_pixels: int = 1003520

    # --- record ---
    log_samples: int = 4
    """responses kept per step in the run record"""
    save_every: int = 0
    """checkpoint every N steps (0: only at the end)"""
    report_to: list = field(default_factory=list)
    """extra scalar sinks: tensorboard, wandb"""

    def __post_init__(self):
        self.c2_range, self.c3_range = tuple(self.c2_range), tuple(self.c3_range)
        self.bac_clip_low_range, self.bac_clip_high_range = tuple(self.bac_clip_low_range), tuple(self.bac_clip_high_range)
        for f in dataclasses.fields(self):  # YAML reads 1e-6 as a string: coerce numbers by annotation
            value, kind = getattr(self, f.name), f.type.split(" ")[0]
            if kind in ("int", "float") and isinstance(value, (str, int, float)) and not isinstance(value, bool):
                try:
                    number = float(value) if kind == "float" else int(value)
                except ValueError:
                    raise ValueError(f"{f.name}={value!r} is not {'a number' if kind == 'float' else 'an integer'}") from None
                if kind == "int" and number != float(value):
                    raise ValueError(f"{f.name}={value!r} is not an integer")
                setattr(self, f.name, number)
        checks = [
            (self.group_size >= 2, "group_size must be >= 2 (GRPO needs a group); set group_size=8"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.delay >= 1, "delay (v) must be >= 1; delay=1 is on-policy"),
            (self.reeval_every >= 1, "reeval_every (m) must be >= 1"),
            (self.online_filter in ("range", "gaussian", "uniform", "none"),
             f"online_filter={self.online_filter!r}: choose range, gaussian, uniform or none"),
            (self.promote in ("threshold", "improved"), f"promote={self.promote!r}: choose threshold or improved"),
            (self.micro_batch_size >= 1 and self.mini_batch_size >= 1, "mini/micro batch sizes must be >= 1"),
            (0 <= self.c1 < 1, "c1 must be in [0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        get_policy_loss(self.loss)  # unknown names fail here, listing the known ones
        self.loss_config()  # and so do bad loss settings

    def loss_config(self, **extra) -> LossConfig:
        """The loss settings as the loss functions take them (`extra`: e.g. bac_reduce)."""
        fields = {f.name for f in dataclasses.fields(LossConfig)} - {"name", "agg", "bac_reduce"}
        return LossConfig(name=self.loss, agg=self.loss_agg, **{k: getattr(self, k) for k in fields}, **extra)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
}

FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _parse_value(key: str, text: str):
    if key not in FIELDS:
        raise KeyError(f"unknown config key {key!r}; known keys: {', '.join(sorted(FIELDS))}")
    return yaml.safe_load(text)


def load_config(preset: str | None = None, file: str | None = None, overrides: list[str] = ()) -> Config:
    """Config from a preset name (presets/<name>.yaml), then a YAML file, then `key=value` overrides.
    `algo=...` expands to its preset fields before the other overrides, so `algo=dapo clip_high=0.3` works."""
    values: dict[str, Any] = {}
    for path in [PRESET_DIR / f"{preset or 'tiny'}.yaml", file]:
        if path is None:
            continue
        path = Path(path)
        if not path.is_file():
            known = ", ".join(p.stem for p in sorted(PRESET_DIR.glob("*.yaml")))
            raise FileNotFoundError(f"config {path} not found (presets: {known})")
        data = yaml.safe_load(path.read_text()) or {}
        for key in data:
            if key not in FIELDS:
                raise KeyError(f"{path}: unknown config key {key!r}")
        values.update(data)
    pairs = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        pairs.append((key.strip(), _parse_value(key.strip(), text)))
    algo = dict(pairs).get("algo", values.get("algo", "bapo"))
    if algo not in ALGOS:
        raise ValueError(f"algo={algo!r}: choose one of {', '.join(ALGOS)}")
    values.update(ALGOS[algo], algo=algo)
    values.update(pairs)
    return Config(**values)
