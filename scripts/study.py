"""The algorithm-neutral study (bapo_vl/study.py): a grid of entries x seeds at one rollout budget, judged on a
held-out split; writes results.md, accuracy.png, updates.png, unlocked.png, forest.png and results.json. See
docs/study/README.md.

    python scripts/study.py --algos grpo,dapo,bapo --seeds 0,1,2 --budget 30720 --k 8 --final-k 32 \
        --extend dapo=2 device=cuda
"""
import sys

from bapo_vl.study import cli

if __name__ == "__main__":
    sys.exit(cli())
