"""Config: each default declared once (presets state only changes), names checked against the registries, and
`bapo train --help` listing every field with its default and doc."""
import dataclasses
import re

import pytest
import yaml

from bapo_vl.algorithm import ONLINE_FILTERS, PROMOTE_RULES, register_filter, register_promote
from bapo_vl.cli import main
from bapo_vl.config import FIELDS, PRESET_DIR, Config, field_default, field_docs, load_config, read_config_file

PRESETS = sorted(PRESET_DIR.glob("*.yaml"))


def coerced(key, value):
    """`value` as Config stores it (YAML reads 1.0e-6 as a string, lists where Config keeps tuples)."""
    return getattr(Config(**{key: value}), key)


# --- presets -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_presets_state_only_what_differs_from_config(path):
    fields = read_config_file(path)
    fields.pop("preset", None)  # the preset it builds on (verl_*)
    restated = [key for key, value in fields.items() if coerced(key, value) == field_default(FIELDS[key])]
    assert not restated, f"{path.name} restates Config's defaults: {restated}"


# The effective values before the presets lost their restated defaults (they must not change).
EFFECTIVE = {
    "tiny": dict(task="countdown", task_options={"template": "compact"}, model="countdown-tiny", device="cpu",
                 steps=60, batch_size=32, group_size=8, max_prompt_length=64, max_response_length=40, lr=2e-4,
                 mini_batch_size=16, micro_batch_size=128, kl_coef=0.0, entropy_coef=0.0),
    "countdown": dict(task="countdown", task_options={"template": "chat"}, model="Qwen/Qwen2.5-Math-1.5B", steps=117,
                      batch_size=256, group_size=8, max_prompt_length=2048, max_response_length=1024, lr=1e-6,
                      mini_batch_size=64, micro_batch_size=8, kl_coef=0.001, entropy_coef=0.001, save_every=20),
    "math": dict(task="math", model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", steps=471, batch_size=256,
                 group_size=8, temperature=1.0, top_p=1.0, max_prompt_length=2048, max_response_length=8192,
                 lr=1e-6, mini_batch_size=64, micro_batch_size=4, kl_coef=0.001, entropy_coef=0.001, save_every=50),
    "geometry3k": dict(task="geometry3k", model="Qwen/Qwen2.5-VL-3B-Instruct", steps=25, batch_size=256,
                       group_size=8, max_prompt_length=2048, max_response_length=2048, lr=1e-6, mini_batch_size=64,
                       micro_batch_size=4, kl_coef=0.001, entropy_coef=0.001, min_pixels=3136, max_pixels=1003520,
                       save_every=10),
}


@pytest.mark.parametrize("preset", EFFECTIVE)
def test_presets_load_to_the_same_effective_config(preset):
    cfg = load_config(preset=preset)
    assert {key: getattr(cfg, key) for key in EFFECTIVE[preset]} == EFFECTIVE[preset]
    assert (cfg.algo, cfg.delay, cfg.c1, cfg.loss) == ("bapo", 5, 1 / 8, "ppo_clip")


@pytest.mark.parametrize("task", ["countdown", "math", "geometry3k"])
def test_verl_presets_are_their_preset_with_save_every_10(task):
    cfg = load_config(f"verl_{task}")  # `bapo train --preset verl_<task>`
    assert {key: getattr(cfg, key) for key in EFFECTIVE[task]} == {**EFFECTIVE[task], "save_every": 10}
    assert cfg.backend == "verl" and cfg.verl["actor_rollout_ref.rollout.name"] == "vllm"
    pytest.importorskip("verl")
    from bapo_vl.backends.verl_main import load_configs

    assert load_configs(str(PRESET_DIR / f"verl_{task}.yaml"), [])[0] == cfg  # the older entry point: the same


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads(path):
    assert isinstance(load_config(path.stem), Config)


# --- names checked against the registries ------------------------------------------------------------------


def test_a_registered_filter_or_promote_rule_is_a_valid_config_name(monkeypatch):
    with pytest.raises(ValueError, match="online_filter='top_half': choose one of range, gaussian, uniform, none"):
        Config(online_filter="top_half")
    with pytest.raises(ValueError, match="promote='any': choose one of threshold, improved"):
        Config(promote="any")
    monkeypatch.setitem(ONLINE_FILTERS, "top_half", None)  # teardown removes what is registered below
    monkeypatch.setitem(PROMOTE_RULES, "any", None)
    register_filter("top_half")(lambda groups, cfg, rng: [g for g in groups if g.mu >= 0.5])
    register_promote("any")(lambda new, old, c1: new.mu > 0)
    cfg = Config(online_filter="top_half", promote="any")
    assert (cfg.online_filter, cfg.promote) == ("top_half", "any")
    with pytest.raises(ValueError, match="range, gaussian, uniform, none, top_half"):  # the message lists it too
        Config(online_filter="nope")


# --- bapo train --help ---------------------------------------------------------------------------------------


def test_field_docs_are_the_attribute_docstrings():
    docs = field_docs()
    assert docs["group_size"] == "G: responses per prompt"
    assert docs["kl_coef"].startswith("β: weight of the k3 estimate")  # a loss field: LossConfig's doc
    assert docs["temperature"].startswith("sampling temperature")
    assert [f for f in FIELDS if not docs.get(f)] == []  # every setting says what it does


def test_train_help_lists_every_field_with_its_default_and_doc(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["train", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "--preset" in out  # the usual options come first
    for f in dataclasses.fields(Config):
        line = re.search(rf"^  {f.name}=(.*?)(?:  |$)", out, re.M)
        assert line, f"{f.name} is not listed"
        # the default is shown as one types it after key=: it reads back to the same value
        assert coerced(f.name, yaml.safe_load(line.group(1))) == field_default(f), line.group(0)
    assert re.search(r"^  group_size=8 +G: responses per prompt$", out, re.M)
    assert re.search(r"^sampling:$", out, re.M)  # grouped by the `# --- sampling ---` comments
