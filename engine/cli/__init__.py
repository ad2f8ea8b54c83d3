"""`batchllm`: the command line (`plan`, `run`, `bench`, `doctor`, `prepare-model`)."""
