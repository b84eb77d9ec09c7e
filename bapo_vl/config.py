"""The one config object. Every default is declared here, once; presets (YAML) and `key=value` overrides
change fields by name. Paper defaults are SPEC section 4; fields marked [code] follow the authors' code."""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bapo_vl.algorithm import ONLINE_FILTERS, PROMOTE_RULES
from bapo_vl.losses import LossConfig, get_policy_loss

PRESET_DIR = Path(__file__).parent / "presets"
# Config fields that LossConfig takes under the same name (Config's loss and loss_agg are its name and agg)
SHARED_LOSS_FIELDS = {f.name for f in dataclasses.fields(LossConfig)} - {"name", "agg", "bac_reduce"}


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
    """a run directory to continue from its latest complete checkpoint, with the config recorded there (only steps,
    save_every, log_samples, report_to, device, run_dir may change)"""
    seed: int = 42
    """seeds data order, sampling and BAPO's random choices"""
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
    """-1: no top-k cut"""
    max_prompt_length: int = 2048
    """tokens, images included; a longer prompt is an error"""
    max_response_length: int = 8192
    """tokens generated per response at most"""
    generate_batch_size: int = 256
    """sequences per generate call"""

    # --- BAPO batch adaptation ---
    delay: int = 5
    """v: the rollout policy is synchronised with the trainer every v steps (v=1: on-policy)"""
    online_filter: str = "range"
    """X1 filter (algorithm.ONLINE_FILTERS): range (keep 1/G <= mu <= (G-1)/G) | gaussian | uniform | none"""
    gaussian_mean: float = 0.5
    """gaussian filter: keep a group with probability exp(-(mu - mean)^2 / (2 std^2))"""
    gaussian_std: float = 0.2
    uniform_keep: float = 0.6
    """uniform filter: the fraction of groups kept"""
    use_x2: bool = True
    """re-evaluate B_bad and promote improved prompts (X2)"""
    reeval_every: int = 5
    """m: re-evaluation frequency in steps"""
    reeval_max: int = 128
    """at most this many B_bad prompts are re-evaluated"""
    promote: str = "threshold"
    """X2 rule (algorithm.PROMOTE_RULES): threshold (c1 < mu_new < 1, paper) | improved (mu_new > mu_old, [code])"""
    use_x3: bool = True
    """replay high-quality groups from B_high (X3)"""
    high_max_age: int = 3
    """B_high keeps groups of the most recent steps only"""
    high_max_uids: int | None = None
    """[code] caps B_high at 8 uids; None = uncapped (paper)"""
    c1: float = 1 / 8
    """fresh groups with mu <= c1 go to B_bad (the X2 source)"""
    c2_range: tuple = (1 / 8, 4 / 8)
    """[low, high] of c2, the lower bound of mu for B_high: c2 = low + r_tot * (high - low) (eq. 8)"""
    c3_range: tuple = (2 / 8, 5 / 8)
    """[low, high] of c3, the upper bound of mu for B_high (eq. 8)"""
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
    # loss defaults are declared once, in losses.LossConfig; so are their docs (field_docs reads them there)
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
    critic: bool = False
    """BA-PPO (paper A.9): a learned critic and GAE (gamma = lam = 1) instead of GRPO's group baseline"""
    critic_lr: float = 1e-5
    """critic: learning rate of the value model"""
    value_clip: float = 0.5
    """critic: clipped value loss, |V − V_old| <= value_clip"""
    tis_threshold: float | None = None
    """[code] token-level truncated importance sampling threshold (3 in the authors' code); None = off"""
    adv_eps: float = 1e-6
    """ε of the GRPO advantage (r - mean) / sqrt(std^2 + ε)"""

    # --- images (vision-language models) ---
    min_pixels: int = 3136
    """the processor resizes each image to between min_pixels and max_pixels pixels"""
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
            # the registries decide which names exist, so a newly registered filter or rule is valid here too
            (self.online_filter in ONLINE_FILTERS,
             f"online_filter={self.online_filter!r}: choose one of {', '.join(ONLINE_FILTERS)}"),
            (self.promote in PROMOTE_RULES, f"promote={self.promote!r}: choose one of {', '.join(PROMOTE_RULES)}"),
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
        shared = {k: getattr(self, k) for k in SHARED_LOSS_FIELDS}
        return LossConfig(name=self.loss, agg=self.loss_agg, **shared, **extra)

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


# --- field docs: the string literal after each field (an attribute docstring), read from the source ------------

SECTION = re.compile(r"\s*# --- (.+?) ---")


@functools.cache
def _attribute_docs(cls) -> tuple[dict[str, str], dict[str, str]]:
    """({field: doc}, {field: section}) of a dataclass: a field's doc is the string literal right after it,
    its section the last `# --- name ---` comment above it (comments are not in the AST: read the lines)."""
    source = inspect.getsource(cls)
    lines, body = source.splitlines(), ast.parse(source).body[0].body
    docs, sections = {}, {}
    for node, after in zip(body, [*body[1:], None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[name] = " ".join(inspect.cleandoc(after.value.value).split())
        headings = [m.group(1) for line in lines[:node.lineno - 1] if (m := SECTION.match(line))]
        sections[name] = headings[-1] if headings else ""
    return docs, sections


def field_docs() -> dict[str, str]:
    """{field: doc} of Config; the loss fields without a doc of their own take LossConfig's."""
    loss_docs = {k: doc for k, doc in _attribute_docs(LossConfig)[0].items() if k in SHARED_LOSS_FIELDS}
    return {**loss_docs, **_attribute_docs(Config)[0]}


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def as_override(value) -> str:
    """A value as one types it after `key=` (YAML, which load_config parses)."""
    text = yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True, width=10**6)
    return text.strip().removesuffix("...").strip()


def config_help() -> str:
    """Every Config field with its default and doc, grouped by section (the epilog of `bapo train --help`)."""
    docs, sections = field_docs(), _attribute_docs(Config)[1]
    rows = [(sections[f.name], f"{f.name}={as_override(field_default(f))}", docs.get(f.name, ""))
            for f in dataclasses.fields(Config)]
    width = min(max(len(key) for _, key, _ in rows), 32)
    out = ["config fields, key=value, with Config's defaults (the preset, tiny unless --preset, and algo= change some):"]
    section = None
    for row_section, key, doc in rows:
        if row_section != section:
            section = row_section
            out.append(f"\n{section}:")
        if len(key) > width and doc:
            key += "\n  " + " " * width  # too long for the column: the doc goes on the next line
        out.append(f"  {key:{width}s}  {doc}".rstrip())
    return "\n".join(out)


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`key=value` strings -> (key, YAML value) pairs; unknown keys and items without `=` are refused."""
    pairs = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        if key not in FIELDS:
            raise KeyError(f"unknown config key {key!r}; known keys: {', '.join(sorted(FIELDS))}")
        pairs.append((key, yaml.safe_load(text)))
    return pairs


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
    pairs = parse_overrides(overrides)
    algo = dict(pairs).get("algo", values.get("algo", "bapo"))
    if algo not in ALGOS:
        raise ValueError(f"algo={algo!r}: choose one of {', '.join(ALGOS)}")
    values.update(ALGOS[algo], algo=algo)
    values.update(pairs)
    return Config(**values)
