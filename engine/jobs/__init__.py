"""A batch end to end, above the run and vLLM stages: open an engine and run a prepared batch so a
kill loses nothing (`resume`), or spread it over Ray replicas (`distributed`)."""
