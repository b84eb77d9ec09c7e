"""The verl backend's older entry point, kept for its commands:

    python -m bapo_vl.backends.verl_main --config FILE [bapo.KEY=VALUE ...] [verl.DOTTED.KEY=VALUE ...]

is `bapo train backend=verl --config FILE [KEY=VALUE ...] [verl.DOTTED.KEY=VALUE ...]` (bapo_vl/verl_launch.py),
e.g. `--config bapo_vl/presets/verl_math.yaml` is `bapo train --preset verl_math`. FILE may have the older layout
(`preset:`, the fields under `bapo:`, `verl:`). With `bapo.resume=DIR` the run's recorded config is taken, as by
`bapo train resume=DIR`, with FILE's `verl:` keys (how verl runs) over the recorded ones.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bapo_vl.config import as_override, config_layers, load_config, resume_config
from bapo_vl.verl_launch import compose, launch


def config(path: str, overrides: list[str]):
    """Our Config for `--config path` and the `bapo.` / `verl.` overrides, as `bapo train backend=verl` loads it."""
    given = []
    for item in overrides:
        scope, _, rest = item.partition(".")
        if scope not in ("bapo", "verl"):
            raise ValueError(f"override {item!r}: prefix it with bapo. or verl.")
        given.append(rest if scope == "bapo" else item)
    resume = [o.partition("=")[2] for o in given if o.partition("=")[0] == "resume"]
    if not resume:
        return load_config(file=path, overrides=["backend=verl", *given])
    verl = {k: v for _, data in config_layers(Path(path)) for k, v in (data.get("verl") or {}).items()}
    changes = [o for o in given if o.partition("=")[0] != "resume"]
    return resume_config(resume[-1], [f"verl={as_override(verl)}", *changes])


def load_configs(path: str, overrides: list[str]):
    """(our Config, verl's OmegaConf config), as `bapo train backend=verl` composes them."""
    cfg = config(path, overrides)
    return cfg, compose(cfg)


def main(argv=None):
    ap = argparse.ArgumentParser(description="BAPO on verl 0.9.1 (Ray + FSDP + vLLM); `bapo train backend=verl` "
                                 "is the same")
    ap.add_argument("--config", required=True, help="a presets/verl_*.yaml file")
    ap.add_argument("overrides", nargs="*", help="bapo.KEY=VALUE or verl.DOTTED.KEY=VALUE")
    args = ap.parse_args(argv)
    launch(config(args.config, args.overrides))


if __name__ == "__main__":
    main()
