"""Stage 3, the run: BatchLLM admission (the scheduler) and the loop that joins it to any `Engine`
(`requests`), results and checkpoints, progress. Knows the engine protocol only, never vLLM."""
