"""Config: each default declared once (presets state only changes), names checked against the registries, and
`bapo train --help` listing every field with its default and doc."""
import dataclasses
import json
import re

import pytest
import yaml

from bapo_vl.algorithm import ONLINE_FILTERS, PROMOTE_RULES, register_filter, register_promote
from bapo_vl.cli import main
from bapo_vl.config import (FIELDS, GROUP_OF, GROUPS, PRESET_DIR, BapoSettings, Config, ConfigError, EmbeddedOptions,
                            OptimSettings, RunSettings, SamplingSettings, UnknownKey, VerlOptions, field_default,
                            field_docs, fields_of, key_of, load_config, read_config_file, resume_config)
from bapo_vl.loss_config import LossConfig
from bapo_vl.record import RunRecord

PRESETS = sorted(PRESET_DIR.glob("*.yaml"))


def coerced(key, value):
    """`value` as Config stores it (YAML reads 1.0e-6 as a string, lists where Config keeps tuples)."""
    return Config.from_dict({key: value}).to_dict()[key]


# --- presets -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_presets_state_only_what_differs_from_config(path):
    fields = read_config_file(path)
    fields.pop("preset", None)  # the preset it builds on (verl_*)
    restated = [key for key, value in fields.items() if coerced(key, value) == field_default(FIELDS[key])]
    assert not restated, f"{path.name} restates Config's defaults: {restated}"


# The presets' effective values: a change here changes a paper setup, on purpose only (geometry3k's micro-batches
# of 2 fit a 141 GB card, math's checkpointing and scoring of 8 sequences at a time an 80 GB one).
EFFECTIVE = {
    "tiny": dict(task="countdown", task_options={"template": "compact"}, model="countdown-tiny", device="cpu",
                 steps=60, batch_size=32, group_size=8, max_prompt_length=64, max_response_length=40, lr=2e-4,
                 mini_batch_size=16, micro_batch_size=128, kl_coef=0.0, entropy_coef=0.0),
    "countdown": dict(task="countdown", task_options={"template": "chat"}, model="Qwen/Qwen2.5-Math-1.5B", steps=117,
                      batch_size=256, group_size=8, max_prompt_length=2048, max_response_length=1024, lr=1e-6,
                      mini_batch_size=64, micro_batch_size=8, kl_coef=0.001, entropy_coef=0.001, save_every=20),
    "math": dict(task="math", model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", steps=471, batch_size=256,
                 group_size=8, temperature=1.0, top_p=1.0, max_prompt_length=2048, max_response_length=8192,
                 lr=1e-6, mini_batch_size=64, micro_batch_size=4, gradient_checkpointing=True, score_batch_size=8,
                 kl_coef=0.001, entropy_coef=0.001, save_every=50),
    "geometry3k": dict(task="geometry3k", model="Qwen/Qwen2.5-VL-3B-Instruct", steps=25, batch_size=256,
                       group_size=8, max_prompt_length=2048, max_response_length=2048, lr=1e-6, mini_batch_size=64,
                       micro_batch_size=2, kl_coef=0.001, entropy_coef=0.001, min_pixels=3136, max_pixels=1003520,
                       save_every=10),
}


@pytest.mark.parametrize("preset", EFFECTIVE)
def test_presets_load_to_the_same_effective_config(preset):
    cfg = load_config(preset=preset)
    assert {key: cfg.to_dict()[key] for key in EFFECTIVE[preset]} == EFFECTIVE[preset]
    assert (cfg.run.algo, cfg.bapo.delay, cfg.bapo.c1, cfg.loss.name) == ("bapo", 5, 1 / 8, "ppo_clip")


@pytest.mark.parametrize("task", ["countdown", "math", "geometry3k"])
def test_verl_presets_are_their_preset_with_save_every_10(task):
    cfg = load_config(f"verl_{task}")  # `bapo train --preset verl_<task>`
    assert {key: cfg.to_dict()[key] for key in EFFECTIVE[task]} == {**EFFECTIVE[task], "save_every": 10}
    assert cfg.run.backend == "verl" and cfg.verl.overrides["actor_rollout_ref.rollout.name"] == "vllm"
    pytest.importorskip("verl")
    from bapo_vl.backends.verl_main import load_configs

    assert load_configs(str(PRESET_DIR / f"verl_{task}.yaml"), [])[0] == cfg  # the older entry point: the same


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads(path):
    assert isinstance(load_config(path.stem), Config)


# --- names checked against the registries ------------------------------------------------------------------


def test_a_registered_filter_or_promote_rule_is_a_valid_config_name(monkeypatch):
    with pytest.raises(ValueError, match="online_filter='top_half': choose one of range, gaussian, uniform, none"):
        Config.from_dict(dict(online_filter="top_half"))
    with pytest.raises(ValueError, match="promote='any': choose one of threshold, improved"):
        Config.from_dict(dict(promote="any"))
    monkeypatch.setitem(ONLINE_FILTERS, "top_half", None)  # teardown removes what is registered below
    monkeypatch.setitem(PROMOTE_RULES, "any", None)
    register_filter("top_half")(lambda groups, cfg, rng: [g for g in groups if g.mu >= 0.5])
    register_promote("any")(lambda new, old, c1: new.mu > 0)
    cfg = Config.from_dict(dict(online_filter="top_half", promote="any"))
    assert (cfg.bapo.online_filter, cfg.bapo.promote) == ("top_half", "any")
    with pytest.raises(ValueError, match="range, gaussian, uniform, none, top_half"):  # the message lists it too
        Config.from_dict(dict(online_filter="nope"))


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
    docs = field_docs()
    for key, f in FIELDS.items():
        line = re.search(rf"^  {key}=(.*?)(?:  |$)", out, re.M)
        assert line, f"{key} is not listed"
        # the default is shown as one types it after key=: it reads back to the same value
        assert coerced(key, yaml.safe_load(line.group(1))) == field_default(f), line.group(0)
        assert docs[key] and docs[key] in " ".join(out[line.start():].split()), f"{key} is listed without its doc"
    assert re.search(r"^  group_size=8 +G: responses per prompt$", out, re.M)
    # a section per group, each listing exactly that group's keys
    sections = re.split(r"^(\w+): .*$", out.split("\n\n", 1)[1], flags=re.M)[1:]
    listed = {group: re.findall(r"^  (\w+)=", body, re.M) for group, body in zip(sections[::2], sections[1::2])}
    assert listed == {group: [key_of(f) for f in fields_of(settings)] for group, settings in GROUPS.items()}


# --- nested groups, flat keys ------------------------------------------------------------------------------------


def test_each_group_holds_its_fields():
    assert {group: type(getattr(Config(), group)) for group in GROUPS} == {
        "run": RunSettings, "sampling": SamplingSettings, "bapo": BapoSettings, "optim": OptimSettings,
        "loss": LossConfig, "embedded": EmbeddedOptions, "verl": VerlOptions}
    where = {"task": "run", "seed": "run", "steps": "run", "resume": "run", "save_every": "run",
             "batch_size": "sampling", "group_size": "sampling", "max_pixels": "sampling",
             "delay": "bapo", "c2_range": "bapo", "reeval_every": "bapo", "dynamic_sampling_rounds": "bapo",
             "lr": "optim", "mini_batch_size": "optim", "critic": "optim", "adv_eps": "optim",
             "loss": "loss", "loss_agg": "loss", "kl_coef": "loss", "bac_step": "loss",
             "micro_batch_size": "embedded", "rollout_engine": "embedded", "verl": "verl"}
    assert {key: GROUP_OF[key] for key in where} == where
    # keys are unique across groups, and name each field once: every field of every group has one
    assert sorted(FIELDS) == sorted(key_of(f) for settings in GROUPS.values() for f in fields_of(settings))
    assert (FIELDS["loss"].name, FIELDS["loss_agg"].name, FIELDS["verl"].name) == ("name", "agg", "overrides")
    assert "bac_reduce" not in FIELDS  # set where the loss runs, not a setting


def test_a_flat_override_lands_in_its_group():
    cfg = load_config(overrides=["delay=2", "lr=1e-5", "loss=gspo", "loss_agg=seq-mean-token-sum", "top_k=20",
                                 "task_options={template: chat}", "backend=verl", "verl.trainer.nnodes=2"])
    assert (cfg.bapo.delay, cfg.optim.lr, cfg.sampling.top_k) == (2, 1e-5, 20)
    assert cfg.run.task_options == {"template": "chat"}
    assert (cfg.loss.name, cfg.loss.agg, cfg.verl.overrides) == ("gspo", "seq-mean-token-sum", {"trainer.nnodes": "2"})
    assert cfg.optim == dataclasses.replace(load_config().optim, lr=1e-5)  # the other groups' fields stay


def test_an_unknown_key_is_one_line_and_group_names_are_no_keys(capsys):
    with pytest.raises(UnknownKey, match=r"^unknown config key 'dealy'; did you mean delay( or \w+)*\?$"):
        load_config(overrides=["dealy=2"])
    with pytest.raises(UnknownKey, match=r"^unknown config key 'bapo\.delay'; keys are flat: delay=$"):
        load_config(overrides=["bapo.delay=2"])
    with pytest.raises(UnknownKey, match="unknown config key 'optim'"):
        Config.from_dict({"optim": {"lr": 1.0}})
    assert main(["train", "sampling.top_k=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown config key 'sampling.top_k'; keys are flat: top_k=" in err and "\n" not in err


def test_checks_name_the_flat_key():
    with pytest.raises(ConfigError, match=r"^loss_agg='mean': choose one of token-mean,") as e:
        Config.from_dict({"loss_agg": "mean"})
    assert e.value.key == "loss_agg"
    with pytest.raises(ConfigError, match=r"^dual_clip=0\.5 must be > 1"):  # LossConfig's own check
        Config.from_dict({"dual_clip": 0.5})
    with pytest.raises(ConfigError, match=r"^min_pixels=9 is above max_pixels=4$"):
        Config.from_dict({"min_pixels": 9, "max_pixels": 4})
    with pytest.raises(ConfigError, match=r"^lr=0\.0: must be > 0$"):  # checked in a group built in Python, too
        Config(optim=OptimSettings(lr=0.0))


def test_to_dict_is_flat_and_from_dict_inverts_it():
    cfg = load_config("geometry3k", overrides=["algo=dapo", "seed=7", "backend=verl", "verl.trainer.nnodes=2"])
    flat = cfg.to_dict()
    assert list(flat) == list(FIELDS) and flat["loss_agg"] == "token-mean" and flat["verl"] == {"trainer.nnodes": "2"}
    assert Config.from_dict(flat) == cfg and Config.from_dict(Config().to_dict()) == Config()
    assert Config.from_dict(json.loads(json.dumps(flat))) == cfg  # as a run record stores it (tuples as lists)
    flat["verl"]["trainer.nnodes"] = "3"
    assert cfg.verl.overrides == {"trainer.nnodes": "2"}  # a copy: the record's dict is not the config's


# A run record's config as bapo-vl wrote it before Config had groups (flat keys), by hand: some fields of today are
# missing (their defaults apply), `backend` is in the record's meta.
OLD_RECORD = {"task": "countdown", "task_options": {"template": "compact"}, "model": "countdown-tiny", "seed": 3,
              "steps": 2, "device": "cpu", "algo": "bapo", "batch_size": 4, "group_size": 4, "temperature": 1.0,
              "max_prompt_length": 64, "max_response_length": 8, "delay": 2, "online_filter": "range",
              "c2_range": [0.125, 0.5], "lr": 0.0002, "loss": "ppo_clip", "loss_agg": "token-mean", "kl_coef": 0.0,
              "clip_high": 0.28, "micro_batch_size": 128, "save_every": 0, "keep_checkpoints": 2, "report_to": []}


def test_an_old_flat_record_resumes_into_the_groups(tmp_path):
    run_dir = tmp_path / "old"
    RunRecord.create(run_dir, OLD_RECORD, name="old", backend="embedded").close()
    cfg = resume_config(run_dir, ["steps=5"])
    assert (cfg.run.steps, cfg.run.resume, cfg.run.seed, cfg.run.backend) == (5, str(run_dir), 3, "embedded")
    assert (cfg.bapo.delay, cfg.bapo.c2_range, cfg.sampling.batch_size) == (2, (0.125, 0.5), 4)
    assert (cfg.optim.lr, cfg.loss.clip_high, cfg.embedded.micro_batch_size) == (2e-4, 0.28, 128)
    assert cfg.bapo.reeval_max == BapoSettings().reeval_max  # not in the old record: the default
    expected = {**Config().to_dict(), **OLD_RECORD, "c2_range": (0.125, 0.5), "steps": 5, "resume": str(run_dir),
                "backend": "embedded"}
    assert cfg.to_dict() == expected


def test_a_backend_is_built_from_the_groups_it_reads():
    from bapo_vl.backends.embedded import EmbeddedBackend

    cfg = load_config(overrides=["delay=1", "kl_coef=0", "top_k=3"])
    backend = EmbeddedBackend(cfg.run.model, cfg.sampling, cfg.optim, cfg.loss, cfg.embedded, device="cpu", seed=0,
                              steps=cfg.run.steps, delay=cfg.bapo.delay)
    assert (backend.sampling, backend.optim, backend.loss, backend.options) == \
        (cfg.sampling, cfg.optim, cfg.loss, cfg.embedded)
    assert backend.rollout is backend.policy and backend.ref is None and backend.generation.top_k == 3
    assert not hasattr(backend, "cfg")
