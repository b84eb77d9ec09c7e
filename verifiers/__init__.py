"""Answer checking: pure functions from (model output, ground truth) to a Verdict."""
