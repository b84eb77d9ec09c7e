"""The GPU benchmark scripts on CPU, up to the GPU: scripts/bench_gpu.py measures the transformers engine, behaviour
scoring and the update of the bundled policy and reports them; both reports read the committed results of docs/bench
(one folder per machine) into the tables docs/results.md quotes. What needs a GPU (vLLM, verl, the bound's copy rate)
is not run."""
import json
import subprocess
import sys
from pathlib import Path

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
    run(ROOT / "scripts" / "bench_gpu.py", "update", "--model", POLICY, "--repeat", "1", "--out", update,
        "--set", "device=cpu", cwd=tmp_path)
    u = json.loads(update.read_text())
    assert u["tokens"] == 16 * 1024 and u["seconds"] > 0 and u["mfu"] is None  # no peak FLOP/s for a CPU
    compiled = tmp_path / "compiled.json"  # the A/B arm: the decoder under torch.compile (CPU: inductor's C++)
    run(ROOT / "scripts" / "bench_gpu.py", "update", "--model", POLICY, "--repeat", "1", "--out", compiled,
        "--set", "device=cpu", "--compile", cwd=tmp_path)
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
