"""The benchmarks: the comparison with vLLM's baselines (`compare`, each run in a fresh process), our
scheduler's cost per step and the batch's fill at GPU settings on a block-accounting stand-in."""
