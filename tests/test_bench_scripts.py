"""The GPU benchmark scripts on CPU, up to the GPU: scripts/bench_gpu.py measures the transformers engine, behaviour
scoring and the update of the bundled policy and reports them; both reports read the committed results of docs/bench
(one folder per machine) into the tables docs/results.md quotes. What needs a GPU (vLLM, verl, the bound's copy rate)
is not run."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "bapo_vl" / "policy" / "countdown-tiny"


def results_with(name: str) -> list[Path]:
    """The result files of the one docs/bench folder (one machine's run) that holds a file `name`."""
    folders = sorted({p.parent for p in (ROOT / "docs" / "bench").glob(f"*/{name}")})
    assert len(folders) == 1, f"{name}: expected in one docs/bench folder, found in {folders}"
    return sorted(folders[0].glob("*.json"))


def run(*args, cwd=None) -> str:
    out = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_bench_gpu_measures_the_transformers_engine_and_the_update_on_cpu(tmp_path):
    # Could fail if the engine bench stopped counting tokens / decode steps, or the update bench broke on the backend.
    engine, update = tmp_path / "engine.json", tmp_path / "update.json"
    settings = ["--set", "device=cpu", "max_response_length=8", "generate_batch_size=8"]
    run(ROOT / "scripts" / "bench_gpu.py", "engine", "--engine", "transformers", "--shape", "text", "--model", POLICY,
        "--prompts", "2,4", "--no-probe-cb", "--out", engine, *settings, cwd=tmp_path)
    rows = json.loads(engine.read_text())["rows"]
    # each size with gqa_decode's attention (the engine) and with transformers' SDPA (the path before it)
    assert [(r["path"], r["prompts"], r["sequences"]) for r in rows] == [
        ("transformers", 2, 16), ("transformers-sdpa", 2, 16), ("transformers", 4, 32), ("transformers-sdpa", 4, 32)]
    for r in rows:  # model.generate in chunks of 8 rows, each chunk decoded to its longest row
        chunks = (r["sequences"] + 7) // 8
        assert 0 < r["tokens"] <= 8 * r["sequences"] and r["longest"] <= 8
        assert r["longest"] <= r["decode_steps"] <= r["longest"] * chunks and r["decode_steps"] >= chunks
    # --sync-debug counts the calls that wait for the GPU in one more update: CUDA only, so here it says so and
    # records nothing
    out = subprocess.run([sys.executable, ROOT / "scripts" / "bench_gpu.py", "update", "--model", POLICY, "--repeat",
                          "1", "--out", update, "--sync-debug", "--set", "device=cpu"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--sync-debug needs CUDA" in out.stderr
    u = json.loads(update.read_text())
    assert u["tokens"] == 16 * 1024 and u["seconds"] > 0 and u["mfu"] is None  # no peak FLOP/s for a CPU
    assert "sync_calls" not in u
    compiled = tmp_path / "compiled.json"  # the A/B arm: the blocks under torch.compile (CPU: inductor's C++)
    run(ROOT / "scripts" / "bench_gpu.py", "update", "--model", POLICY, "--repeat", "1", "--out", compiled,
        "--set", "device=cpu", "compile=true", cwd=tmp_path)
    assert json.loads(compiled.read_text())["compiled"] and not u["compiled"]
    copy = tmp_path / "copy.json"  # the other A/B arm: bf16 compute copy against bf16 autocast
    run(ROOT / "scripts" / "bench_gpu.py", "update", "--model", POLICY, "--repeat", "1", "--out", copy,
        "--set", "device=cpu", "dtype=bfloat16", "mixed_precision=compute_copy", cwd=tmp_path)
    assert json.loads(copy.read_text())["mixed_precision"] == "compute_copy" and u["mixed_precision"] == "autocast"
    score = tmp_path / "score.json"  # behaviour scoring at score_batch_size 4 and 16 against micro_batch_size 2
    run(ROOT / "scripts" / "bench_gpu.py", "score", "--shape", "text", "--model", POLICY, "--prompts", "2",
        "--batch", "4,16", "--out", score, *settings[:-1], "micro_batch_size=2", cwd=tmp_path)
    s = json.loads(score.read_text())
    assert s["sequences"] == 16 and 4 * 16 <= s["tokens"] <= 8 * 16
    assert [r["score_batch_size"] for r in s["rows"]] == [2, 4, 16] and all(r["seconds"] > 0 for r in s["rows"])
    assert "| 2 (micro_batch_size) | " in run(ROOT / "scripts" / "bench_gpu.py", "report", score)
    # the same work in chunks of 16 rows: compared with the chunks of 8 (the chunk size changes how, not what)
    wide = tmp_path / "wide.json"
    run(ROOT / "scripts" / "bench_gpu.py", "engine", "--engine", "transformers", "--shape", "text", "--model", POLICY,
        "--prompts", "4", "--no-probe-cb", "--out", wide, *settings[:-1], "generate_batch_size=16", cwd=tmp_path)
    table = run(ROOT / "scripts" / "bench_gpu.py", "report", engine, wide, update, compiled, copy)
    assert "update (cpu): 16 x 1,024 tokens" in table and "update (cpu, torch.compile): 16 x 1,024 tokens" in table
    assert "update (cpu, compute_copy): 16 x 1,024 tokens" in table
    assert table.count("x the first update of this card") == 2  # both arms against the first
    assert "waited for the GPU" not in table  # no count without --sync-debug on CUDA
    counted = tmp_path / "counted.json"  # what a CUDA run with --sync-debug adds, as the report shows it
    counted.write_text(json.dumps(dict(u, sync_calls=3, sync_sites={"bapo_vl/backends/embedded.py:80": 2,
                                                                    "bapo_vl/losses.py:113": 1})))
    assert ("3 calls waited for the GPU in one update (bapo_vl/backends/embedded.py:80 x2, bapo_vl/losses.py:113 x1)"
            in run(ROOT / "scripts" / "bench_gpu.py", "report", counted))
    lines = table.splitlines()
    # every row against transformers' SDPA at the default chunk size, same prompts: the chunk size and the
    # attention change how, not what
    sdpa = {r["prompts"]: r for r in rows if r["path"] == "transformers-sdpa"}
    for chunk, file in ((8, engine), (16, wide)):
        for r in json.loads(file.read_text())["rows"]:
            line = [x for x in lines if f"| {r['path']} | cpu |" in x and f"generate_batch_size={chunk} | {r['prompts']} x 8 |" in x]
            assert len(line) == 1 and f"| {r['tokens_per_s'] / sdpa[r['prompts']]['tokens_per_s']:.2f}x |" in line[0]


def test_reports_of_the_committed_two_h200_results():
    # Could fail if a report compared rows across settings it should not, or lost the same-machine ratios.
    files = results_with("engine-text-transformers256.json")
    steps = run(ROOT / "scripts" / "gpu" / "bench_backends.py", "report", *files)
    assert "| embedded (vllm engine) | NVIDIA H200 | rollout_engine=vllm | 11.82 |" in steps
    assert "2.85x" in steps and "| verl, 2 GPU, vLLM eager | NVIDIA H200 | - | 22.90 |" in steps
    assert "| verl, 1 GPU, vLLM eager | NVIDIA H200 | - | 56.97 |" in steps and "0.88x" in steps
    engines = run(ROOT / "scripts" / "bench_gpu.py", "report", *files)
    assert "| vllm | NVIDIA H200 | - | 64 x 8 | 26,556 | 7.56 | 201 / 512 | 9.49x | 3.3% |" in engines
    assert "MFU 13.5%" in engines


def test_report_of_the_committed_preset_memory_results():
    # Could fail if the report dropped the record's GPU memory or nvidia-smi's peak, which docs/results.md quotes, or
    # lost the peak of a run that did not finish (the one that ran out of memory).
    steps = run(ROOT / "scripts" / "gpu" / "bench_backends.py", "report", *results_with("preset-math-sb8.json"))
    assert "| score_batch_size=8 | 84.52 |" in steps and steps.count("| 100.5 / 58.3 (100.5) |") == 1
    assert "| 80.4 / 80.8 (80.8) |" in steps and "| 129.5 / 124.0 (129.5) |" in steps
    assert "| gradient_checkpointing=false | failed: rc=1 0 steps recorded | | | | | | | | - / - (150.0) |" in steps


def test_reports_of_the_committed_two_h100_results():
    # Could fail if the A/B arm (an env switch, not a Config field) were not told apart from the default row, or if
    # the update's profile (what bounds its MFU) were dropped from the report.
    files = results_with("text-verl1-rowloop.json")
    steps = run(ROOT / "scripts" / "gpu" / "bench_backends.py", "report", *files)
    assert "| verl, 1 GPU, vLLM eager | NVIDIA H100 80GB HBM3 | - | 31.96 |" in steps and "1.15x" in steps
    assert "| verl, 1 GPU, vLLM eager | NVIDIA H100 80GB HBM3 | env BAPO_VERL_ROW_LOOP_LOGPROBS=1 | 63.52 |" in steps
    assert "| embedded (vllm engine) | NVIDIA H100 80GB HBM3 | micro_batch_size=2 rollout_engine=vllm | 43.88 |" in steps
    update = run(ROOT / "scripts" / "bench_gpu.py", "report", *files)
    assert "MFU 13.1%" in update and "aten::mm" in update and "Self CUDA time total: 177.449ms" in update


def test_reports_of_the_committed_two_h200_cuda_graph_results():
    # Could fail if a verl row lost its vLLM mode, a ratio were taken against another shape's embedded row, or an
    # engine setting (vllm_options, generate_batch_size) were dropped from its row.
    files = results_with("engine-text-vllm-graphs1024.json")
    steps = run(ROOT / "scripts" / "gpu" / "bench_backends.py", "report", *files)
    assert "| verl, 1 GPU, vLLM cuda graphs | NVIDIA H200 | - | 20.29 |" in steps and "| 1.59x |" in steps
    assert "| verl, 2 GPU, vLLM cuda graphs | NVIDIA H200 | - | 26.77 |" in steps and "| 1.71x |" in steps
    assert "| - / - |" in steps  # recorded before generate's split: shown as unknown, not as 0
    engines = run(ROOT / "scripts" / "bench_gpu.py", "report", *files)
    assert "| vllm | NVIDIA H200 | vllm_options={max_num_seqs: 512} | 256 x 8 | 21,406 | 37.02 |" in engines
    assert "| transformers | NVIDIA H200 | generate_batch_size=512 | 64 x 8 | 3,532 | 72.77 | 257 / 512 | 1.28x |" in engines


def test_reports_of_the_committed_vl_and_scoring_results():
    # Could fail if the generate split, a row's changed settings (a ratio across batch sizes) or the scoring table's
    # baseline (the update's micro_batch_size) were lost from the reports that docs/results.md quotes.
    files = results_with("vl-verl1-20.json")
    steps = run(ROOT / "scripts" / "gpu" / "bench_backends.py", "report", *files)
    assert "| verl, 1 GPU, vLLM cuda graphs | NVIDIA H200 | batch_size=8 mini_batch_size=8 | 17.06 |" in steps
    assert "- (other card or settings)" in steps and "| 2.08 / 12.89 |" in steps and "| 12.91 / 8.55 |" in steps
    engines = run(ROOT / "scripts" / "bench_gpu.py", "report", *files)
    assert "| transformers | NVIDIA H200 | - | 64 x 8 | 2,782 | 45.49 | 253 / 512 | 1.23x |" in engines
    assert "| vllm | NVIDIA H200 | - | 16 x 8 | 14,980 | 7.83 | 235 / 256 | 10.74x |" in engines
    assert "MFU 16.8%" in engines and "MFU 14.8%" in engines
    scoring = run(ROOT / "scripts" / "bench_gpu.py", "report", *results_with("score-text.json"))
    assert "| 2 (micro_batch_size) | 15.57 | 1.00x |" in scoring and "| 32 | 2.72 | 5.72x |" in scoring
    assert "| 16 (micro_batch_size) | 4.63 | 1.00x |" in scoring and "| 64 | 1.16 | 4.00x |" in scoring
    assert "| vllm | NVIDIA H200 | - | 16 x 8 | 14,450 |" in scoring and "| vllm-plain | NVIDIA H200 | - | 16 x 8 | 16,508 |" in scoring


BENCH = ROOT / "scripts" / "gpu" / "bench_backends.py"
G3K = ROOT / "tests" / "fixtures" / "geometry3k"
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, min_pixels=56 * 56, max_pixels=224 * 224,
            vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1]))


def bench_backends():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_backends
    finally:
        sys.path.remove(str(BENCH.parent))
    return bench_backends


def test_steps_summary_gives_the_medians_of_the_train_times_parts(tmp_path):
    # A verl run's record splits t_train by the actor's calls; the summary takes their medians over the steps after
    # the first, as it does t_train's, and leaves a profiled step out. Could fail if a part were dropped, taken from
    # the warm-up or the profiled step, or invented for a run that does not record them (the embedded backend).
    from bapo_vl.record import RunRecord

    parts = ("batch", "engine_sleep", "logprobs", "actor")
    for name, split in (("verl", True), ("embedded", False)):
        with RunRecord.create(tmp_path / name, {}) as record:
            for step in range(1, 5):
                m = dict(rollouts=8, response_length=10.0, t_generate=1.0, t_train=10.0 * step, t_verify=0.1,
                         t_sync=0.0)
                if split:
                    m |= {f"t_train_{p}": step * (i + 1) for i, p in enumerate(parts)}
                else:  # a GPU run of the embedded backend records its memory by phase
                    m |= dict(gpu_memory_generate_gb=[5.0, 9.0, 6.0, 6.0][step - 1], gpu_memory_train_gb=20.0 + step)
                record.log_step(step, m)
        got = bench_backends().steps_summary(tmp_path / name / "run.db")
        assert got["train_s"] == 30.0  # steps 2-4
        assert got["train_parts_s"] == ({p: 3.0 * (i + 1) for i, p in enumerate(parts)} if split else None)
        # memory is the most of any step (the warm-up's too), not a median
        assert got["gpu_memory_gb"] == (None if split else dict(generate=9.0, train=24.0))
        profiled = bench_backends().steps_summary(tmp_path / name / "run.db", untimed={2, 3, 4})  # none timed
        assert "error" in profiled and profiled["gpu_memory_gb"] == got["gpu_memory_gb"]  # memory needs no timing
        profiled = bench_backends().steps_summary(tmp_path / name / "run.db", untimed={2})  # --profile-step 2
        assert profiled["timed_steps"] == [3, 4] and got["timed_steps"] == [2, 3, 4]
        assert profiled["train_s"] == 35.0


def test_vl3b_model_is_qwen2_5_vl_3b(tmp_path):
    # Could fail if the shape drifted from Qwen2.5-VL-3B's config.json, or the padded vocabulary did not reach the
    # model (its embedding and LM head are 8 % of the parameters and of the FLOPs EasyR1 counts).
    from bapo_vl import tiny
    from bapo_vl.perf import model_flops

    spec = bench_backends().MODELS["vl3b"]
    assert {k: spec[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab_size")} == dict(
        hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab_size=151936)
    assert spec["vision"] == "VISION_3B" and tiny.VISION_3B["depth"] == 32 and tiny.VISION_3B["hidden_size"] == 1280
    # the real model's vocabulary under a tiny body: ids past the byte tokenizer's exist and decode to nothing
    model, processor = bench_backends().build("vl3b", **TINY, vocab_size=4096)
    text = model.config.text_config
    assert text.vocab_size == 4096 > len(processor.tokenizer) and model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.shape == (4096, 64)
    assert processor.tokenizer.decode([72, 105, 4000], skip_special_tokens=True) == "Hi"
    padded = model_flops(dict(hidden_size=2048, num_hidden_layers=36, vocab_size=151936, num_attention_heads=16,
                              num_key_value_heads=2, intermediate_size=11008), [1])
    assert 6 * 2 * 151936 * 2048 / padded > 0.15  # why the vocabulary is padded: the head is a sixth of the count


def test_text151k_is_the_text_shape_with_qwens_vocabulary():
    # Could fail if the padded vocabulary did not reach the text model (the update bench would then measure the LM
    # head of the byte tokenizer's 263 words, not a real model's 151,936) or the body drifted from the text shape's.
    models = bench_backends().MODELS
    assert models["text151k"] == dict(models["text"], vocab_size=151936)
    model, tok = bench_backends().build("text151k", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                                        vocab_size=4096)
    assert model.config.vocab_size == 4096 > len(tok) and model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.shape == (4096, 64)
    assert bench_backends().build("text", hidden=64, layers=2, heads=4, kv_heads=2,
                                  intermediate=128)[0].config.vocab_size == len(tok)


def test_the_preset_shapes_run_the_presets_on_their_models_architectures(tmp_path):
    # Could fail if a preset shape ran something other than the preset (its lengths, micro-batches, checkpointing,
    # delay and KL reference are what the card must hold) or its model drifted from the preset's model: the math
    # preset's DeepSeek-R1-Distill-Qwen-1.5B has an LM head of its own, 0.23 B parameters more to hold in fp32 + AdamW.
    from bapo_vl.config import load_config

    bb = bench_backends()
    for shape, model in (("math", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
                         ("countdown", "Qwen/Qwen2.5-Math-1.5B"), ("geometry3k", "Qwen/Qwen2.5-VL-3B-Instruct")):
        _, cmd, _ = bb.command(shape, "embedded", 1, tmp_path / shape, 2, None, tmp_path, [])
        got = bb.check("embedded", 1, cmd)["config"]
        preset = load_config(shape).to_dict()
        assert preset["model"] == model  # what the shape's random-weight model stands for
        changed = {k for k in preset if got[k] != preset[k]}
        assert changed == {"model", "batch_size", "online_filter", "device", "save_every", "log_samples", "steps",
                           "run_dir", "name"}
        assert got["batch_size"] == 8 and got["steps"] == 2
    spec = bb.MODELS["math"]
    assert {k: spec[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab_size")} == dict(
        hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab_size=151936)
    assert bb.MODELS["countdown"] | dict(tie_word_embeddings=False, max_position_embeddings=131072) == spec
    small = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab_size=4096)
    untied, _ = bb.build("math", **small)
    tied, _ = bb.build("countdown", **small)
    assert not untied.config.tie_word_embeddings and tied.config.tie_word_embeddings
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == 4096 * 64


@pytest.fixture(scope="module")
def vl3b_tiny(tmp_path_factory):
    """A vl3b-shaped model small enough for a CPU: tiny body, padded vocabulary (so sampled ids past the tokenizer's
    go through the whole step), saved as the `models` subcommand saves it."""
    out = tmp_path_factory.mktemp("vl3b") / "vl3b"
    model, processor = bench_backends().build("vl3b", **TINY, vocab_size=2048)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def test_vl3b_rows_compose_at_easyr1s_per_gpu_setting(vl3b_tiny, tmp_path):
    # Could fail if --gpus stopped scaling the batch per GPU, a verl key were misspelt or refused by verl's own
    # config (Hydra composes verl's real ppo_trainer.yaml here, and its ActorConfig checks the batch split), or the
    # embedded row lost the settings its memory arithmetic depends on.
    verl, emb = tmp_path / "verl.json", tmp_path / "embedded.json"
    common = ["--shape", "vl3b", "--model", vl3b_tiny, "--source", G3K, "--check"]
    run(BENCH, "train", *common, "--backend", "verl", "--gpus", "2", "--out", verl, cwd=tmp_path)
    run(BENCH, "train", *common, "--backend", "embedded", "--out", emb, cwd=tmp_path)
    v, e = json.loads(verl.read_text()), json.loads(emb.read_text())
    for cfg, prompts in ((v["config"], 128), (e["config"], 64)):  # 64 prompts x 5 per GPU, 2048 + 2048 tokens
        assert (cfg["batch_size"], cfg["group_size"], cfg["mini_batch_size"]) == (prompts, 5, prompts // 4)
        assert (cfg["max_prompt_length"], cfg["max_response_length"], cfg["delay"], cfg["kl_coef"]) == (2048, 2048, 1, 0)
        assert (cfg["min_pixels"], cfg["max_pixels"], cfg["task"]) == (262144, 4194304, "geometry3k")
    assert (e["config"]["micro_batch_size"], e["config"]["mixed_precision"]) == (1, "autocast")
    vc, actor, rollout = v["verl"], v["verl"]["actor_rollout_ref"]["actor"], v["verl"]["actor_rollout_ref"]["rollout"]
    assert vc["trainer"]["n_gpus_per_node"] == 2 and vc["data"]["train_batch_size"] == 128
    assert (actor["ppo_mini_batch_size"], actor["ppo_micro_batch_size_per_gpu"], rollout["n"]) == (32, 8, 5)
    assert vc["actor_rollout_ref"]["model"]["use_fused_kernels"]
    assert actor["fsdp_config"]["param_offload"] and actor["fsdp_config"]["optimizer_offload"]
    assert rollout["free_cache_engine"] and rollout["gpu_memory_utilization"] == 0.6 and not rollout["enforce_eager"]
    assert (rollout["tensor_model_parallel_size"], rollout["log_prob_micro_batch_size_per_gpu"]) == (1, 16)


def test_verl_rows_take_other_update_micro_batches_through_set(vl3b_tiny, tmp_path):
    # benchmarks/vl3b.sh passes VERL_SET to the verl rows as --set. Could fail if a verl override stopped reaching
    # verl's composed config, or if verl's ActorConfig refused 16 sequences a micro-batch for the vl3b batch split
    # (64 prompts x 5 in 4 mini-batches: 80 sequences each).
    out = tmp_path / "verl.json"
    run(BENCH, "train", "--shape", "vl3b", "--model", vl3b_tiny, "--source", G3K, "--check", "--backend", "verl",
        "--gpus", "1", "--set", "verl.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "--out", out,
        cwd=tmp_path)
    actor = json.loads(out.read_text())["verl"]["actor_rollout_ref"]["actor"]
    assert (actor["ppo_mini_batch_size"], actor["ppo_micro_batch_size_per_gpu"]) == (16, 16)


def test_profile_step_composes_verls_torch_profiler_for_the_actor(vl3b_tiny, tmp_path):
    # Could fail if verl's own config refused a profiler key (Hydra composes verl's ppo_trainer.yaml and verl's
    # ProfilerConfig dataclass takes the actor's part), the step did not reach the backend's rule, or the embedded
    # backend took the flag silently.
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from bapo_vl.backends.verl_backend import profiled_steps

    out = tmp_path / "verl.json"
    run(BENCH, "train", "--shape", "vl3b", "--model", vl3b_tiny, "--source", G3K, "--check", "--backend", "verl",
        "--profile-step", "2", "--run-dir", tmp_path / "runs", "--out", out, cwd=tmp_path)
    vcfg = OmegaConf.create(json.loads(out.read_text())["verl"])
    assert profiled_steps(vcfg) == (2,)
    assert vcfg.global_profiler.save_path == str(tmp_path / "runs" / "profile-vl3b-verl1-step2")
    profiler = omega_conf_to_dataclass(vcfg.actor_rollout_ref.actor.profiler)
    torch_tool = profiler.tool_config["torch"]
    assert (profiler.tool, profiler.enable, list(torch_tool.contents)) == ("torch", True, ["cuda"])
    assert torch_tool.schedule.active == 1 and torch_tool.schedule.skip_first == 0
    refused = subprocess.run([sys.executable, BENCH, "train", "--shape", "vl3b", "--model", vl3b_tiny, "--check",
                              "--backend", "embedded", "--profile-step", "2", "--out", tmp_path / "e.json"],
                             capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode == 1 and "bench_gpu.py update --profile" in refused.stderr


def test_vl3b_run_reports_easyr1s_figures_and_the_ratio(vl3b_tiny, tmp_path):
    # Could fail if the tokens/s per GPU lost the prompt tokens (EasyR1 counts prompt + response), divided by the
    # wrong time or GPU count, if the actor MFU took verl's whole t_train rather than its update_actor call, or if the
    # ratio were taken across cards or shapes.
    import sqlite3

    from bapo_vl.backends.embedded import PromptEncoder
    from bapo_vl.config import Config
    from bapo_vl.train import load_problems

    shrink = ["device=cpu", "batch_size=2", "mini_batch_size=1", "max_response_length=6", "min_pixels=3136",
              "max_pixels=50176"]
    files = {}
    for name, steps, extra in (("base", 2, ["generate_batch_size=4"]), ("row", 3, [])):
        files[name] = tmp_path / f"{name}.json"
        run(BENCH, "train", "--shape", "vl3b", "--backend", "embedded", "--model", vl3b_tiny, "--source", G3K,
            "--steps", steps, "--run-dir", tmp_path / name, "--out", files[name], "--set", *shrink, *extra, cwd=tmp_path)
    row, base = (json.loads(files[k].read_text()) for k in ("row", "base"))
    assert row["rc"] == 0 and row["weights"] == "random" and row["card"] == "cpu" and row["actor_mfu"] is None
    assert row["peak_gpu_memory_gb"] is None and row["peak_gpu_memory_gb_by_card"] is None  # no nvidia-smi here
    # the record's figures, recomputed: prompt tokens of each step's fresh prompts (x G) + its responses
    db = tmp_path / "row" / "bench-vl3b-embedded1" / "run.db"
    conn = sqlite3.connect(db)
    cfg = Config.from_dict(json.loads(conn.execute("SELECT json FROM config").fetchone()[0]))
    steps = conn.execute("SELECT step, time, metrics FROM steps ORDER BY step").fetchall()
    uids = conn.execute("SELECT step, uid, G FROM prompt_steps WHERE subset IN ('x1', 'filtered')").fetchall()
    conn.close()
    encode = PromptEncoder(str(vl3b_tiny), cfg.sampling)
    problems = {p.uid: p for p in load_problems(cfg.run)[1]}
    rates = []
    for (_, t0, _), (step, t1, m) in zip(steps, steps[1:]):
        m = json.loads(m)
        prompts = sum(G * len(encode(problems[uid])["input_ids"]) for s, uid, G in uids if s == step)
        assert prompts > m["rollouts"] * 4  # each prompt carries its diagram's image tokens
        rates.append((prompts + m["rollouts"] * m["response_length"]) / (t1 - t0))
    assert len(rates) == 2 and abs(row["tokens_per_gpu_s"] - sorted(rates)[0] / 2 - sorted(rates)[1] / 2) < 1e-6
    # the actor MFU (on a card with a peak) divides by the update's time: a verl record's update_actor call, where the
    # record splits t_train, else t_train; a quarter of the time, four times the MFU
    mfu = bench_backends().easyr1_figures(db, vl3b_tiny, 1, "NVIDIA H100")["actor_mfu"]
    conn = sqlite3.connect(db)
    with conn:
        for step, _, m in steps:
            m = json.loads(m)
            conn.execute("UPDATE steps SET metrics = ? WHERE step = ?",
                         (json.dumps(dict(m, t_train_actor=m["t_train"] / 4)), step))
    conn.close()
    assert mfu > 0 and bench_backends().easyr1_figures(db, vl3b_tiny, 1, "NVIDIA H100")["actor_mfu"] == \
        pytest.approx(4 * mfu)
    out = json.loads(run(BENCH, "summary", files["row"], "--baseline", files["base"], cwd=tmp_path))
    assert out["row"] == "embedded (default engine)" and out["commit"] and out["date"] == row["date"]
    assert "peak_gpu_memory_gb" in out
    assert out["tokens_per_gpu_s_x_baseline"] == row["tokens_per_gpu_s"] / base["tokens_per_gpu_s"]
    other = tmp_path / "other.json"  # the same figures from another card: no ratio
    other.write_text(json.dumps(dict(base, card="1 x NVIDIA H100 80GB HBM3")))
    assert json.loads(run(BENCH, "summary", files["row"], "--baseline", other))["tokens_per_gpu_s_x_baseline"] is None


def test_update_bench_of_the_vl3b_shape_trains_diagrams_and_counts_both_towers(vl3b_tiny, tmp_path):
    # Could fail if benchmarks/update.sh with a Geometry3K folder did not measure both arms on the VL shape, if the VL
    # update lost the prompts' images (then no patch is counted and the prompts are short), if the responses were not
    # at the shape's cap, if the vision tower's parameters were counted over every token (or not at all), if the LM
    # head tied to the embedding were left out of the FLOPs (or counted over the prompts, where it does not run), if
    # the report compared it with a text update, or if the summary took a ratio across work.
    from transformers import AutoModelForImageTextToText

    from bapo_vl.backends.embedded import PromptEncoder
    from bapo_vl.config import load_config
    from bapo_vl.train import load_problems

    shrink = ["device=cpu", "max_response_length=8", "min_pixels=3136", "max_pixels=50176"]
    env = dict(os.environ, BENCH_DIR=str(tmp_path), REPEAT="1", PROMPTS="2", SET=" ".join(shrink))
    done = subprocess.run(["bash", ROOT / "benchmarks" / "update.sh", vl3b_tiny, G3K], capture_output=True, text=True,
                          timeout=900, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    out, compiled = tmp_path / "compute-copy.json", tmp_path / "compute-copy-compiled.json"
    r, c = json.loads(out.read_text()), json.loads(compiled.read_text())
    assert (r["shape"], r["sequences"], r["micro_batch_size"], r["mfu"]) == ("vl3b", 10, 1, None)  # 2 x 5, CPU
    assert c["compiled"] and not r["compiled"] and c["tokens"] == r["tokens"]
    assert summary["shape"] == "vl3b" and summary["speed_x_baseline"] == r["seconds"] / c["seconds"]
    cfg = load_config("geometry3k", None, [f"model={vl3b_tiny}", f"task_options={{source: {G3K}}}", *shrink])
    encode = PromptEncoder(str(vl3b_tiny), cfg.sampling)
    prompts = [encode(p) for p in load_problems(cfg.run)[1][:2]]
    lengths = [len(p["input_ids"]) + 8 for p in prompts for _ in range(5)]
    patches = 5 * sum(int(p["image_grid_thw"].prod(-1).sum()) for p in prompts)
    assert r["tokens"] == sum(lengths) and r["longest"] == max(lengths) and patches > 0
    model = AutoModelForImageTextToText.from_pretrained(vl3b_tiny)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    text = model.config.text_config
    assert text.tie_word_embeddings and "lm_head.weight" not in dict(model.named_parameters())
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) - vision
    head = text.vocab_size * text.hidden_size  # over the 2 x 5 responses of 8 tokens
    flops = 6 * body * sum(lengths) + 6 * head * 10 * 8 \
        + 6 * text.num_hidden_layers * text.hidden_size * sum(n * n for n in lengths) + 6 * vision * patches
    assert r["tflops"] * r["seconds"] * 1e12 == pytest.approx(flops, rel=1e-9)
    text_row = tmp_path / "text.json"
    text_row.write_text(json.dumps(dict(r, shape="text", sequences=16, tokens=16 * 1024, seconds=r["seconds"] / 2)))
    report = run(ROOT / "scripts" / "bench_gpu.py", "report", out, text_row)
    assert "10 sequences of the vl3b shape, " in report and "x the first update of this card" not in report
    other = json.loads(run(ROOT / "scripts" / "bench_gpu.py", "summary", out, "--baseline", text_row))
    assert other["shape"] == "vl3b" and other["speed_x_baseline"] is None  # other work: no ratio


def test_update_flops_count_the_tower_once_per_prompt_in_a_micro_batch(vl3b_tiny, tmp_path):
    # Could fail if the update's FLOPs counted the vision tower per sequence where a micro-batch of one prompt's five
    # rows encodes its images once (bapo_vl.shared_images), or counted the update's no-grad scoring as well.
    from transformers import AutoModelForImageTextToText

    from bapo_vl.backends.embedded import PromptEncoder
    from bapo_vl.config import load_config
    from bapo_vl.train import load_problems

    out = tmp_path / "mb5.json"
    run(ROOT / "scripts" / "bench_gpu.py", "update", "--shape", "vl3b", "--model", vl3b_tiny, "--source", G3K,
        "--prompts", "1", "--repeat", "1", "--set", "device=cpu", "max_response_length=8", "min_pixels=3136",
        "max_pixels=50176", "micro_batch_size=5", "--out", out, cwd=tmp_path)
    r = json.loads(out.read_text())
    model = AutoModelForImageTextToText.from_pretrained(vl3b_tiny)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    text = model.config.text_config
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) - vision
    lengths = [r["tokens"] // 5] * 5  # one prompt's five rows of 8 response tokens
    assert sum(lengths) == r["tokens"] and r["sequences"] == 5
    without_tower = 6 * body * r["tokens"] + 6 * text.vocab_size * text.hidden_size * 5 * 8 \
        + 6 * text.num_hidden_layers * text.hidden_size * sum(n * n for n in lengths)
    tower = r["tflops"] * r["seconds"] * 1e12 - without_tower
    cfg = load_config("geometry3k", None, [f"model={vl3b_tiny}", f"task_options={{source: {G3K}}}", "min_pixels=3136",
                                           "max_pixels=50176"])
    prompt = PromptEncoder(str(vl3b_tiny), cfg.sampling)(load_problems(cfg.run)[1][0])
    assert tower == pytest.approx(6 * vision * int(prompt["image_grid_thw"].prod(-1).sum()), rel=1e-6)


def test_update_profile_splits_the_time_by_tower_forward_and_backward(vl3b_tiny, tmp_path):
    # Could fail if the profile lost a part (a tower's forward range not recorded, its backward not found from the
    # forward's autograd sequence numbers, the optimizer step not named), if the parts did not add up to the profiled
    # operators' time, or if the report stopped printing them. A text model has no vision tower part.
    vl, text = tmp_path / "vl.json", tmp_path / "text.json"
    run(ROOT / "scripts" / "bench_gpu.py", "update", "--shape", "vl3b", "--model", vl3b_tiny, "--source", G3K,
        "--prompts", "1", "--repeat", "1", "--profile", "--out", vl, "--set", "device=cpu", "max_response_length=8",
        "min_pixels=3136", "max_pixels=50176", cwd=tmp_path)
    parts = json.loads(vl.read_text())["profile_parts"]
    named = ["vision tower forward", "language model forward", "vision tower backward", "language model backward",
             "optimizer step"]
    assert list(parts) == [*named, "rest", "total", "wall"]
    assert all(parts[k] > 0 for k in named) and parts["rest"] >= 0
    assert sum(parts[k] for k in [*named, "rest"]) == pytest.approx(parts["total"])
    assert parts["total"] <= parts["wall"]
    assert "aten::mm" in json.loads(vl.read_text())["profile"]
    assert "update profile (cpu) by part: vision tower forward " in run(ROOT / "scripts" / "bench_gpu.py", "report", vl)
    run(ROOT / "scripts" / "bench_gpu.py", "update", "--model", POLICY, "--repeat", "1", "--profile", "--out", text,
        "--set", "device=cpu", cwd=tmp_path)
    parts = json.loads(text.read_text())["profile_parts"]
    assert [k for k in parts if "tower" in k or "model" in k] == ["language model forward", "language model backward"]
    assert parts["language model forward"] > 0 and parts["language model backward"] > 0


def test_report_states_the_device_busy_share_against_the_unprofiled_update():
    # Could fail if the share were taken against the profiled call's wall time, which includes the profiler's own
    # host overhead (a 3B update: 1.127 s of kernels in a 5.651 s profiled call, 20 %, but 1.769 s unprofiled).
    row = ROOT / "docs" / "bench" / "2026-11-29-H200-3e9adeb" / "update-vl3b-profile.json"
    out = run(ROOT / "scripts" / "bench_gpu.py", "report", row)
    assert "all 1.127 s, against 1.769 s for the unprofiled update (the device busy 64% of it" in out


def test_profile_parts_on_a_gpu_count_each_kernel_once():
    # Could fail if a GPU trace's ranges were counted twice (the host range and its GPU-side annotation), if a
    # backward node were not found from its forward op's sequence number, or if the kernels' total took in the
    # annotations. torch's own FunctionEvent, as torch.profiler builds it from a CUDA trace.
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from bench_gpu import profile_parts
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    ids = iter(range(100))

    def host(name, start, end, sequence_nr=-1, kernel_us=0, children=(), user=False):
        e = FunctionEvent(next(ids), name, thread=1, start_us=start, end_us=end, sequence_nr=sequence_nr,
                          use_device="cuda", is_user_annotation=user)
        if kernel_us:
            e.append_kernel("sm90_gemm", 0, kernel_us)
        for child in children:
            e.append_cpu_child(child)
            child.set_cpu_parent(e)
        return e

    def device(name, us, user=False):
        return FunctionEvent(next(ids), name, thread=7, start_us=0, end_us=us, use_device="cuda",
                             device_type=DeviceType.CUDA, is_user_annotation=user)

    mm = host("aten::mm", 1, 2, sequence_nr=5, kernel_us=300)
    forward = host("vision tower forward", 0, 10, children=[mm], user=True)
    lm = host("aten::mm", 11, 12, sequence_nr=6, kernel_us=200)
    lm_forward = host("language model forward", 10, 20, children=[lm], user=True)
    mm_back = host("autograd::engine::evaluate_function: MmBackward0", 30, 40, sequence_nr=5,
                   children=[host("aten::mm", 31, 32, kernel_us=600)])
    lm_back = host("autograd::engine::evaluate_function: MmBackward0", 40, 50, sequence_nr=6,
                   children=[host("aten::mm", 41, 42, kernel_us=400)])
    step = host("Optimizer.step#AdamW.step", 50, 60, children=[host("aten::_fused_adamw_", 51, 52, kernel_us=100)])
    head = host("aten::mm", 60, 61, kernel_us=250)  # outside both towers: the rest
    kernels = [device("sm90_gemm", us) for us in (300, 200, 600, 400, 100, 250)]
    events = [forward, mm, lm_forward, lm, mm_back, lm_back, step, head, *kernels,
              device("vision tower forward", 5_000, user=True), device("Optimizer.step#AdamW.step", 900, user=True)]
    parts = profile_parts(events, ["vision tower", "language model"], on_gpu=True, wall=0.004)
    assert parts == pytest.approx({"vision tower forward": 300e-6, "language model forward": 200e-6,
                                   "vision tower backward": 600e-6, "language model backward": 400e-6,
                                   "optimizer step": 100e-6, "rest": 250e-6, "total": 1850e-6, "wall": 0.004})


def test_peak_gpu_memory_is_the_most_each_card_used_while_the_run_ran(tmp_path, monkeypatch):
    # Could fail if a poll replaced the peak instead of raising it, if the cards asked for were not passed to
    # nvidia-smi, if MiB were not turned into GB, or if a card reporting [N/A] broke the parse. nvidia-smi cannot run
    # without a GPU: a stand-in on PATH answers as it does, one line per card, a new reading on each call.
    readings = tmp_path / "readings"
    readings.write_text("0, 1000\n1, 4000\n--\n0, 3000\n1, [N/A]\n--\n0, 2000\n1, 500\n")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path}/args
n=$(cat {tmp_path}/count 2>/dev/null || echo 0)
echo $((n + 1)) > {tmp_path}/count.new && mv {tmp_path}/count.new {tmp_path}/count  # whole: read meanwhile
awk -v n=$n 'BEGIN {{ RS = "--\\n" }} NR == n + 1 {{ printf "%s", $0 }}' {readings}
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    with bench_backends().GpuMemoryPeak("0,1", every=0.05) as memory:
        while not (tmp_path / "count").exists() or int((tmp_path / "count").read_text()) < 4:
            time.sleep(0.02)
    assert memory.peak_gb == pytest.approx({0: 3000 * 2 ** 20 / 1e9, 1: 4000 * 2 ** 20 / 1e9})
    assert "-i 0,1" in (tmp_path / "args").read_text()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with bench_backends().GpuMemoryPeak("0") as memory:
        pass
    assert memory.peak_gb is None


def test_update_benchmark_prints_the_compiled_row_against_the_compute_copy(tmp_path):
    # Could fail if benchmarks/update.sh stopped measuring both arms in one invocation, if the summary's ratio were
    # not the baseline's seconds over the row's, or if it were taken across cards.
    env = dict(os.environ, BENCH_DIR=str(tmp_path), REPEAT="1", SET="device=cpu dtype=bfloat16")
    out = subprocess.run(["bash", ROOT / "benchmarks" / "update.sh", POLICY], capture_output=True, text=True,
                         timeout=900, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    row, base = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("compute-copy-compiled", "compute-copy"))
    assert row["compiled"] and not base["compiled"] and row["mixed_precision"] == base["mixed_precision"] == "compute_copy"
    assert summary["row"] == "update (compute_copy + torch.compile)" and summary["baseline"]["row"] == "update (compute_copy)"
    assert summary["speed_x_baseline"] == base["seconds"] / row["seconds"]
    assert summary["card"] == "cpu" and summary["date"] == row["date"] and summary["commit"]
    other = tmp_path / "other.json"  # the baseline measured on another card: no ratio
    other.write_text(json.dumps(dict(base, card="1 x NVIDIA H200")))
    again = run(ROOT / "scripts" / "bench_gpu.py", "summary", tmp_path / "compute-copy-compiled.json", "--baseline", other)
    assert json.loads(again)["speed_x_baseline"] is None


def test_text_benchmark_reports_a_failed_engine_row_without_a_ratio(tmp_path):
    # Could fail if a failed `bapo train` were recorded with exit status 0 (the row would look like a run that left
    # no record), if the summary took a ratio against a run that failed, or if the failed row lost its reason. vLLM
    # is not installed here, so the vLLM row fails on CPU as it would on a machine without it; the transformers row
    # runs.
    shrink = "device=cpu batch_size=2 group_size=2 max_response_length=8 mini_batch_size=2 micro_batch_size=2"
    env = dict(os.environ, BENCH_DIR=str(tmp_path), STEPS="2", SET=shrink)
    out = subprocess.run(["bash", ROOT / "benchmarks" / "text.sh", POLICY], capture_output=True, text=True,
                         timeout=900, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    base = json.loads((tmp_path / "embedded-transformers.json").read_text())
    assert base["rc"] == 0 and base["tokens_per_gpu_s"] > 0
    assert summary["row"] == "embedded (vllm engine)" and summary["rc"] not in (0, None)
    assert summary["baseline"]["tokens_per_gpu_s"] == base["tokens_per_gpu_s"]
    assert summary["tokens_per_gpu_s_x_baseline"] is None
    assert "rollout_engine=vllm needs vLLM" in (tmp_path / "embedded-vllm.log").read_text()
    # the failed row says why, in its file and its summary (the run's last exception line); a run that did not fail
    # has no failure entry
    assert any("rollout_engine=vllm needs vLLM" in line for line in summary["failure"]), summary.get("failure")
    assert "failure" not in base


def test_sft_benchmark_prints_the_compiled_step_against_the_eager_one(tmp_path):
    # Could fail if benchmarks/sft.sh stopped running both arms in one invocation, timed the first log line (the
    # compilation) into the step, or took the ratio otherwise than the eager step's seconds over the compiled one's.
    env = dict(os.environ, BENCH_DIR=str(tmp_path), SIZE="geodraw-tiny", STEPS="6", LOG_EVERY="2",
               EXTRA="--image-size 112 --batch 4 --data fixed --problems 8 --device cpu")
    out = subprocess.run(["bash", ROOT / "benchmarks" / "sft.sh"], capture_output=True, text=True, timeout=900,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    cards = {n: json.loads((tmp_path / n / "training.json").read_text()) for n in ("eager", "compiled")}
    assert cards["compiled"]["compile"] and not cards["eager"]["compile"]
    assert summary["row"] == "geodraw SFT step (compiled)" and summary["baseline"]["row"] == "geodraw SFT step (eager)"
    for name, row in (("compiled", summary), ("eager", summary["baseline"])):
        timed = [d["step_seconds"] for d in cards[name]["loss_log"] if d["step"] > 1]  # steps 2, 4, 6
        assert row["timed_log_lines"] == 3 and row["step_seconds"] == sorted(timed)[1]
    assert summary["speed_x_baseline"] == summary["baseline"]["step_seconds"] / summary["step_seconds"]
    assert summary["card"] == "cpu" and summary["date"] and summary["commit"]


def test_sft_data_benchmark_prints_the_byte_encoding_against_the_processor(tmp_path):
    # Could fail if benchmarks/sft_data.sh stopped timing both encodings in one invocation, or took the ratios
    # otherwise than the processor's milliseconds over PromptBytes' (with the drawing added to both for the second).
    env = dict(os.environ, N="16", IMAGE_SIZE="112", SIZE="geodraw-tiny")
    out = subprocess.run(["bash", ROOT / "benchmarks" / "sft_data.sh"], capture_output=True, text=True, timeout=900,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(out.stdout)
    assert s["row"] == "geodraw SFT data, per problem" and s["problems"] == 16 and s["image_size"] == 112
    assert s["draw_ms"] > 0 and s["encode_ms"] > 0 and s["baseline"]["encode_ms"] > 0
    assert s["encode_x_baseline"] == pytest.approx(s["baseline"]["encode_ms"] / s["encode_ms"])
    assert s["draw_and_encode_x_baseline"] == pytest.approx(
        (s["draw_ms"] + s["baseline"]["encode_ms"]) / (s["draw_ms"] + s["encode_ms"]))
    assert s["date"] and s["commit"]


def test_trace_summary_reads_a_torch_trace_and_says_where_the_gpu_waited(tmp_path):
    """A Chrome trace as torch.profiler exports it (gzip, as verl's torch profiler writes it): its host events from a
    real profile on CPU, and the GPU's events in the CUDA trace's format (kernels on two streams that overlap, a
    host-to-device copy with its bytes, an annotated range, each GPU event's host launch by correlation id). Could
    fail if overlapping kernels were counted twice in the busy time, a fused Triton softmax were called a softmax, a
    copy's bytes were lost, a gzip trace unread, or a gap charged to the wrong side: the host launched the Triton
    kernel (through the driver API, as Triton does) after the GPU ran dry (its gap is the host's, in the "loss"
    range), the copy before (queued)."""
    import gzip

    import torch

    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    try:
        import trace_summary
    finally:
        sys.path.remove(str(ROOT / "scripts" / "gpu"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("mini_batch0"):
            torch.ones(64, 64) @ torch.ones(64, 64)
    plain = tmp_path / "host.json"
    prof.export_chrome_trace(str(plain))
    events = json.loads(plain.read_text())["traceEvents"]
    assert trace_summary.summarize(events)["gpu_events"] == 0

    def gpu(cat, name, ts, dur, corr, stream=7, **args):
        return dict(ph="X", cat=cat, name=name, pid=0, tid=stream, ts=ts, dur=dur, args=dict(correlation=corr, **args))

    def host(cat, name, ts, dur, corr=None):
        return dict(ph="X", cat=cat, name=name, pid=1, tid=1, ts=ts, dur=dur,
                    args={} if corr is None else dict(correlation=corr))

    events += [gpu("kernel", "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 1000, 400, 1),
               gpu("kernel", "ncclDevKernel_AllGather_RING_LL", 1200, 500, 2, stream=20),  # overlaps the product
               gpu("kernel", "triton_red_fused__softmax__to_copy_add_exp", 2000, 100, 3),
               gpu("kernel", "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>", 2100, 50, 4),
               gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 3000, 1000, 5, bytes=25_000_000_000 // 1000),
               gpu("gpu_user_annotation", "mini_batch0", 1000, 3000, None),
               host("user_annotation", "language model forward", 900, 1600),
               host("cpu_op", "aten::mm", 950, 50), host("cuda_runtime", "cudaLaunchKernel", 960, 10, 1),
               host("cpu_op", "nccl:_all_gather_base", 1010, 40), host("cuda_runtime", "cudaLaunchKernel", 1020, 5, 2),
               host("user_annotation", "loss", 1800, 400),
               host("cpu_op", "CompiledFunction", 1850, 100), host("cpu_op", "triton_red_fused", 1890, 20),
               host("cuda_driver", "cuLaunchKernel", 1900, 10, 3),
               host("cuda_runtime", "cudaLaunchKernel", 1960, 10, 4),
               host("cpu_op", "aten::copy_", 2040, 30), host("cuda_runtime", "cudaMemcpyAsync", 2050, 10, 5)]
    path = tmp_path / "rank0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    [s] = trace_summary.summarize_files([path])
    assert s["trace"] == "rank0.json.gz" and s["devices"] == ["0"] and s["kernels"] == 4
    assert s["span_s"] == pytest.approx(3000e-6)  # 1000 .. 4000 us
    assert s["busy_s"] == pytest.approx((700 + 150 + 1000) * 1e-6)  # 1000-1700, 2000-2150, 3000-4000
    assert s["kernel_s"] == pytest.approx(1050e-6)
    fams = s["families"]
    assert fams["matrix products"]["s"] == pytest.approx(400e-6) and fams["nccl (communication)"]["calls"] == 1
    assert fams["triton (fused)"]["s"] == pytest.approx(100e-6) and "reductions, softmax, norms" not in fams
    assert fams["element-wise"]["share"] == pytest.approx(50 / 1050)
    assert s["copies"] == {"HtoD": pytest.approx(dict(s=1000e-6, calls=1, GB=0.025))}
    assert s["annotations"] == {"mini_batch0": pytest.approx(dict(s=3000e-6, calls=1))}
    assert s["top_kernels"][0]["name"].startswith("ncclDevKernel")
    gaps = s["idle"]
    assert gaps["host_late_s"] == pytest.approx(300e-6) and gaps["queued_s"] == pytest.approx(850e-6)
    assert gaps["unmatched_s"] == 0
    assert [(g["range"], g["op"], g["gaps"]) for g in gaps["by_range"]] == [("(queued)", None, 1),
                                                                           ("loss", "CompiledFunction", 1)]
    assert gaps["largest"][0]["after"].startswith("void at::native::vectorized") and \
        gaps["largest"][0]["before"].startswith("Memcpy HtoD")
    # the host-late gap (GPU dry at 1700 us, the launch at 1900): the thread ran CompiledFunction from 1850, nothing
    # the profiler records before it; a queued gap has no host side
    assert "host" not in gaps["largest"][0]
    assert gaps["largest"][1]["host"] == pytest.approx({"CompiledFunction": 50e-6, "(no operator)": 150e-6})
    table = trace_summary.markdown(s, s["trace"])
    assert "GPU busy 0.002 s of a 0.003 s window (62 %)" in table and "| HtoD | 0.001 | 0.03 | 1 |" in table
    assert "| loss / CompiledFunction | 0.0003 | 1 |" in table
    assert "| 0.30 | loss / CompiledFunction | CompiledFunction 0.05, (no operator) 0.15 |" in table


def test_update_report_prints_where_the_profiled_update_left_the_gpu_idle(tmp_path):
    # Could fail if `report` dropped the timeline of a profiled update or charged its gap to another range.
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    try:
        import trace_summary
    finally:
        sys.path.remove(str(ROOT / "scripts" / "gpu"))
    k = lambda corr, ts: dict(ph="X", cat="kernel", name="nvjet_gemm", pid=0, tid=7, ts=ts, dur=100,
                              args=dict(correlation=corr))
    h = lambda cat, name, ts, dur, **args: dict(ph="X", cat=cat, name=name, pid=1, tid=1, ts=ts, dur=dur, args=args)
    events = [k(1, 0), k(2, 600), h("cuda_runtime", "cudaLaunchKernel", -10, 5, correlation=1),
              h("user_annotation", "optimizer step", 150, 500), h("cpu_op", "aten::_fused_adamw_", 500, 100),
              h("cuda_runtime", "cudaLaunchKernel", 550, 5, correlation=2)]
    row = json.loads((ROOT / "docs" / "bench" / "2026-11-29-2xH200-f3a9609" / "update-text151k-compile.json").read_text())
    row["profile_timeline"] = trace_summary.summarize(events)
    (tmp_path / "u.json").write_text(json.dumps(row))
    out = run(ROOT / "scripts" / "bench_gpu.py", "report", tmp_path / "u.json")
    assert "update timeline (NVIDIA H200): GPU busy 0.000 s of a 0.001 s window (29 %)" in out
    assert "host late 0.001 s, queued 0.000 s, launch not in the trace 0.000 s" in out
    assert "| optimizer step / aten::_fused_adamw_ | 0.0005 | 1 |" in out


def test_activation_memory_counts_what_autograd_keeps_per_token_and_layer():
    # The bundled policy's config. Could fail if the count took in the weights that linear layers keep (then per
    # token would shrink with length), or if checkpointing kept more than each block's bf16 input.
    hidden, layers = (json.loads((POLICY / "config.json").read_text())[k] for k in ("hidden_size", "num_hidden_layers"))
    out = json.loads(run(ROOT / "scripts" / "activation_memory.py", "--config", POLICY, "--tokens", 1000))
    assert out["checkpointed_bytes_per_token_per_layer"] == 2 * hidden
    assert out["bytes_per_token_per_layer"] > 10 * out["checkpointed_bytes_per_token_per_layer"]
    assert out["activations_GB"] == round(out["bytes_per_token_per_layer"] * layers * 1000 / 1e9, 1)
