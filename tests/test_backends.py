"""One front door: `bapo train backend=embedded|verl ...`. The backend registry (config.BACKENDS), each backend's options
(the Config fields only it reads), the one-line refusal of another backend's options, `verl.KEY=VALUE` overrides
merged layer by layer, presets that build on a preset, and run records written before Config had `backend` and
`verl`. The verl launcher's composed config is checked in tests/test_verl.py (it needs verl installed)."""
from __future__ import annotations

import dataclasses
import json
import re
import sqlite3

import pytest

import bapo_vl.train
from bapo_vl.cli import main
from bapo_vl.config import (BACKEND_OF, BACKENDS, FIELDS, PRESET_DIR, Config, ConfigError, EmbeddedOptions,
                            VerlOptions, field_default, field_docs, key_of, launcher, load_config, recorded_config,
                            resume_config)

SHORT = ["steps=1", "batch_size=4", "group_size=4", "max_response_length=8"]


# --- the registry and the options dataclasses -----------------------------------------------------------------

def test_the_registry_names_each_backend_with_its_options_and_launcher():
    assert dict(BACKENDS) == {"embedded": EmbeddedOptions, "verl": VerlOptions}
    assert launcher("embedded") is bapo_vl.train.train
    from bapo_vl import verl_launch  # imports no verl until a run composes its config

    assert launcher("verl") is verl_launch.launch
    assert Config().run.backend == "embedded"
    with pytest.raises(ConfigError, match=r"^backend='ray': choose one of embedded, verl$"):
        Config.from_dict(dict(backend="ray"))


def test_a_registered_backend_is_a_valid_config_name(monkeypatch):
    @dataclasses.dataclass
    class Options:
        LAUNCH = "bapo_vl.train:train"

    monkeypatch.setitem(BACKENDS, "other", None)  # teardown removes what is registered below
    BACKENDS.register("other")(Options)
    assert Config.from_dict(dict(backend="other")).run.backend == "other" and launcher("other") is bapo_vl.train.train


@pytest.mark.parametrize("options", BACKENDS.values(), ids=list(BACKENDS))
def test_each_option_is_a_documented_config_field_with_a_refusal_line(options):
    docs = field_docs()
    for f in dataclasses.fields(options):
        key = key_of(f)
        assert FIELDS[key] is f and BACKENDS[BACKEND_OF[key]] is options
        assert docs.get(key), f"{key} is not documented"
        assert options.INSTEAD[key] and "\n" not in options.INSTEAD[key]
    assert set(options.INSTEAD) == {key_of(f) for f in dataclasses.fields(options)}  # no line for a field gone


def test_options_of_old_records_keep_their_flat_names():
    """A run record's config (and a preset) names each option as a top-level key, as before the options had
    classes of their own."""
    flat = Config().to_dict()
    for name in ("rollout_engine", "vllm_options", "generate_batch_size", "score_batch_size", "micro_batch_size",
                 "dtype", "verl", "backend"):
        assert name in flat
    assert {"rollout_engine", "vllm_options", "generate_batch_size", "score_batch_size", "micro_batch_size", "dtype",
            "verl"} <= set(BACKEND_OF)


def test_train_help_lists_each_backends_options_in_a_section_of_its_own(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    embedded = out.index("\nembedded: options of the embedded backend (backend=embedded)\n")
    verl = out.index("\nverl: options of the verl backend (backend=verl)\n")
    assert out.index("\nloss: ") < embedded < verl
    assert all(embedded < out.index(f"\n  {f.name}=") < verl for f in dataclasses.fields(EmbeddedOptions))
    assert re.search(r"^  verl=\{\} +overrides of verl's ppo_trainer config", out, re.M)
    assert re.search(r"^  backend=embedded +what runs the steps", out, re.M)


# --- refusals: one line naming what to use instead ------------------------------------------------------------

def other_value(f: dataclasses.Field) -> str:
    """A value field `f` takes other than its default, as typed after `key=`."""
    default = field_default(f)
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, int):
        return str(default + 1)
    if isinstance(default, dict):
        return "{enforce_eager: true}"
    return next(v for v in f.metadata["accepted"] if v != default)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(EmbeddedOptions)])
def test_an_embedded_option_given_for_verl_is_refused_naming_the_verl_key(name):
    # Could fail if verl silently ignored a setting the user gave (it used to).
    with pytest.raises(ConfigError) as e:
        load_config("verl_math", overrides=[f"{name}={other_value(FIELDS[name])}"])
    assert re.fullmatch(rf"{name}=.+: the verl backend does not use it; {re.escape(EmbeddedOptions.INSTEAD[name])}",
                        str(e.value))
    assert "verl." in str(e.value) and e.value.key == name


def test_verl_keys_given_for_the_embedded_backend_are_refused(capsys):
    assert main(["train", "verl.trainer.nnodes=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("bapo: verl={'trainer.nnodes': '2'}: the embedded backend does not use it; verl.* keys set "
                   "verl's own config: add backend=verl (the verl_* presets set it), or drop them")
    assert load_config(overrides=["backend=verl", "verl.trainer.nnodes=2"]).verl.overrides == {"trainer.nnodes": "2"}


def test_a_bundled_presets_embedded_options_stay_unused_a_config_files_are_refused(tmp_path):
    cfg = load_config("verl_math")  # built on the math preset, which sets the embedded micro_batch_size
    assert (cfg.run.backend, cfg.embedded.micro_batch_size) == ("verl", 4)
    mine = tmp_path / "mine.yaml"
    mine.write_text("preset: verl_math\nmicro_batch_size: 8\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(mine))}: micro_batch_size=8: the verl backend does not "
                                          r"use it; use verl\.actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu$"):
        load_config(file=str(mine))


def test_the_command_line_refuses_an_embedded_option_on_verl_with_one_line(capsys):
    assert main(["train", "--preset", "verl_tiny", "dtype=bfloat16"]) == 2
    err = capsys.readouterr().err
    assert err == ("bapo: dtype='bfloat16': the verl backend does not use it; verl computes in bf16 under FSDP's "
                   "mixed precision (verl.actor_rollout_ref.actor.fsdp_config)\n")


# --- verl. overrides and presets that build on a preset ----------------------------------------------------------

def test_verl_keys_add_to_those_of_the_layers_below(tmp_path):
    preset = load_config("verl_math").verl.overrides
    mine = tmp_path / "mine.yaml"
    mine.write_text("preset: verl_math\nverl: {trainer.nnodes: 2, trainer.logger: '[console,wandb]'}\n")
    cfg = load_config(file=str(mine), overrides=["verl.trainer.n_gpus_per_node=4", "verl.trainer.nnodes=3"])
    assert cfg.verl.overrides == {**preset, "trainer.nnodes": "3", "trainer.logger": "[console,wandb]",
                        "trainer.n_gpus_per_node": "4"}
    assert list(cfg.verl.overrides)[:len(preset)] == list(preset)  # the preset's keys keep their order


def test_a_config_file_builds_on_the_preset_it_names_not_on_tiny(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("preset: math\nsteps: 3\n")
    cfg = load_config(file=str(mine))
    math = load_config("math")
    assert cfg == Config.from_dict({**math.to_dict(), "steps": 3})
    assert cfg.run.device == "auto"  # tiny's device=cpu is not read
    plain = tmp_path / "plain.yaml"
    plain.write_text("steps: 3\n")
    tiny = load_config()  # no preset named: tiny
    assert load_config(file=str(plain)) == Config.from_dict({**tiny.to_dict(), "steps": 3})


def test_the_verl_launchers_older_file_layout_reads_the_same(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("preset: math\nbapo:\n  save_every: 10\nverl:\n" + "".join(
        f"  {k}: {json.dumps(v)}\n" for k, v in load_config("verl_math").verl.overrides.items()))
    assert load_config(file=str(old), overrides=["backend=verl"]) == load_config("verl_math")
    bad = tmp_path / "bad.yaml"
    bad.write_text("bapo: [steps]\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: bapo: holds `key: value` lines, not a list"):
        load_config(file=str(bad))


def test_every_verl_preset_names_the_verl_backend():
    for path in sorted(PRESET_DIR.glob("verl_*.yaml")):
        assert load_config(path.stem).run.backend == "verl", path.name
    for path in sorted(set(PRESET_DIR.glob("*.yaml")) - set(PRESET_DIR.glob("verl_*.yaml"))):
        assert load_config(path.stem).run.backend == "embedded", path.name


# --- run records written before Config had `backend` and `verl` ---------------------------------------------

def _as_older_record(run_dir, backend: str):
    """Rewrite a run record's config as versions before the backend registry wrote it: no backend, no verl."""
    conn = sqlite3.connect(run_dir / "run.db")
    with conn:
        config = json.loads(conn.execute("SELECT json FROM config").fetchone()[0])
        config = {k: v for k, v in config.items() if k not in ("backend", "verl")}
        conn.execute("UPDATE config SET json = ?", (json.dumps(config),))
        conn.execute("UPDATE meta SET value = ? WHERE key = 'backend'", (backend,))
    conn.close()


def test_an_older_run_record_resumes_with_its_backend(tmp_path, capsys):
    # Could fail if a record without `backend` (every run before it) did not open, or a verl run's resume fell
    # back to the embedded backend.
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=old", *SHORT]) == 0
    run_dir = tmp_path / "old"
    _as_older_record(run_dir, "embedded")
    assert recorded_config(run_dir)["backend"] == "embedded"
    capsys.readouterr()
    assert main(["train", "--quiet", f"resume={run_dir}", "steps=2"]) == 0
    assert "run record:" in capsys.readouterr().out
    _as_older_record(run_dir, "verl")
    cfg = resume_config(run_dir, ["steps=3", "verl.trainer.nnodes=2"])
    assert (cfg.run.backend, cfg.verl.overrides, cfg.run.steps, cfg.embedded.micro_batch_size) == \
        ("verl", {"trainer.nnodes": "2"}, 3, 128)
    with pytest.raises(ConfigError, match="^micro_batch_size=8: the verl backend does not use it"):
        resume_config(run_dir, ["micro_batch_size=8"])


def test_train_builds_only_the_embedded_backend(tmp_path):
    cfg = load_config(overrides=[*SHORT, "backend=verl", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"backend=verl: train\(\) builds the embedded backend"):
        bapo_vl.train.train(cfg, quiet=True)
