# Source on a GPU machine of the device tool, from the repo root, after the stack is unpacked in /tmp/site
# (../shared/tools/gpu-stack/README.md): bapo_vl importable without pip (a copy laid out as the wheel installs it),
# the stack on PYTHONPATH, and the settings that stack needs.
set -e
rm -rf /tmp/shim && mkdir -p /tmp/shim
cp -r bapo_vl /tmp/shim/bapo_vl
cp -r tasks /tmp/shim/bapo_vl/tasks && cp -r verifiers /tmp/shim/bapo_vl/verifiers && cp -r app /tmp/shim/bapo_vl/app
# the entry point pyproject.toml declares, so `import verl` loads bapo_vl.backends.verl_loss in every Ray worker
mkdir -p /tmp/shim/bapo_vl-0.dist-info
printf 'Metadata-Version: 2.1\nName: bapo-vl\nVersion: 0\n' > /tmp/shim/bapo_vl-0.dist-info/METADATA
printf '[verl.plugins]\nbapo_vl = bapo_vl.backends.verl_loss\n' > /tmp/shim/bapo_vl-0.dist-info/entry_points.txt
# bapo-vl's own pure-Python dependencies the stack lacks (qwen-vl-utils), unpacked in .gpu-stack/extra and carried:
#   pip download --no-deps qwen-vl-utils -d /tmp/qv && python -m zipfile -e /tmp/qv/*.whl .gpu-stack/extra
export PYTHONPATH=/tmp/shim:/tmp/site:$PWD/.gpu-stack/extra
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0
export TOKENIZERS_PARALLELISM=true RAY_DEDUP_LOGS=0
set +e
