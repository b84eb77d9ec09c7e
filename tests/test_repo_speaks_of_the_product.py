"""The repository speaks of the product alone: its tracked text files name no issue numbers, no work sessions, no
machines it was developed on (their absolute paths) and none of the scripts that once scheduled its GPU runs.

Every tracked file is read except binary ones (images, archives, weights, parquet), the data files of tests/fixtures
and the raw benchmark logs under docs/bench (console output as it was printed), and this file, whose self-test
holds examples of what is forbidden.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BINARY = {".png", ".jpg", ".jpeg", ".gif", ".webp", ".ico", ".pdf", ".gz", ".zip", ".tar", ".safetensors", ".bin",
          ".pt", ".pth", ".parquet", ".arrow", ".npy", ".npz", ".db", ".sqlite", ".woff", ".woff2", ".ttf"}
RAW_BENCH_LOGS = {".log", ".csv"}  # under docs/bench: output as the runs printed it

# name -> pattern (case-insensitive)
FORBIDDEN = {
    "an issue number": r"\bissues?\s+#?\d+\b",
    "a session number": r"\bsessions?\s+\d+\b|\bsession\d+",
    "the device tool": r"\bdevice\s+tool\b",
    "a development machine's path": (r"(?<![\w./-])[/](?:work|root)[/]"
                                     r"|(?<![\w./-])[/]tmp[/](?:r\d|(?:w|models|runs)[/])"),
    "a deleted GPU plan script": r"device[_]session|study[_]session|\bqueues[.]sh\b|\benv[.]sh\b",
}
PATTERN = re.compile("|".join(f"(?P<p{i}>{p})" for i, p in enumerate(FORBIDDEN.values())), re.IGNORECASE)
NAMES = list(FORBIDDEN)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f]


def checked(path: str) -> bool:
    suffix = Path(path).suffix.lower()
    if path == Path(__file__).relative_to(ROOT).as_posix():
        return False
    if suffix in BINARY:
        return False
    if path.startswith("tests/fixtures/") and suffix != ".md":
        return False
    if path.startswith("docs/bench/") and suffix in RAW_BENCH_LOGS:
        return False
    return (ROOT / path).is_file()


@pytest.fixture(scope="module")
def files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [f for f in tracked_files() if checked(f)]


def hits(path: str) -> list[str]:
    data = (ROOT / path).read_bytes()
    if b"\0" in data[:8192]:  # binary after all
        return []
    found = []
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        for m in PATTERN.finditer(line):
            kind = NAMES[int(next(k for k, v in m.groupdict().items() if v is not None)[1:])]
            found.append(f"{path}:{n}: {kind}: {m.group(0)!r} in {line.strip()[:200]!r}")
    return found


def test_the_check_reads_the_repository(files):
    # Could fail if the file list came back empty or filtered to almost nothing, so the test below passed vacuously.
    assert len(files) > 100, files
    for must in ("README.md", "pyproject.toml", "docs/results.md", "bapo_vl/trainer.py"):
        assert must in files, must


def test_the_patterns_catch_what_they_are_for():
    # Could fail if a pattern were broken (the check would then pass on anything).
    bad = ["see issue 13", "(Issue #12, item 4)", "issues 11", "session 8", "Session 12", "bench-session8",
           "the device tool's calls", "cd /work/main", "`/root/.cache`", "/tmp/r13/.carry/x.jsonl",
           "\"model\": \"/tmp/w/work/models/text\"", "/tmp/models/vl", "run record: /tmp/runs/bench-vl/run.db",
           "bash scripts/gpu/device_session.sh q0", "scripts/gpu/queues.sh", ". scripts/gpu/env.sh",
           "study_session.sh"]
    good = ["pytorch/pytorch#196678", "an issue with the tokenizer", "a session of training", "/tmp/synth",
            "runs/work/x", "https://example.com/work/x", "tissue 3", "/tmp/run",
            "/tmp/bench-runs", "/tmp/synth-grpo", "models/text", "runs/bench-vl/run.db"]
    assert [b for b in bad if not PATTERN.search(b)] == []
    assert [g for g in good if PATTERN.search(g)] == []


def test_no_file_speaks_of_issues_sessions_or_our_machines(files):
    # Could fail if a file named an issue, a work session, the GPU-lending tool, a development machine's path or a
    # deleted plan script: users read these files.
    found = [h for f in files for h in hits(f)]
    assert not found, f"{len(found)} lines speak of something other than the product:\n" + "\n".join(found)


def test_no_tracked_path_names_a_session(files):
    # Could fail if a file or folder were named after a work session (e.g. a results folder).
    names = [f for f in tracked_files() if re.search(r"session[-_ ]?\d+", f, re.IGNORECASE)]
    assert not names, "\n".join(names)
