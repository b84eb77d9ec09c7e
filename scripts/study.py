"""The algorithm-neutral study of issue 13 (bapo_vl/study.py): algorithms x seeds at one rollout budget, judged on
a held-out split; writes results.md, accuracy.png, unlocked.png and results.json. See docs/study/README.md.

    python scripts/study.py --algos grpo,dapo,bapo --seeds 0,1,2 --budget 30720 --k 16 device=cuda
"""
import sys

from bapo_vl.study import main

if __name__ == "__main__":
    sys.exit(main())
