"""Stage 1, the table: reading a dataset (DuckDB, Parquet, SQL), prompts from fields, the prompt
snapshot, and where `batchllm run` writes its answers."""
