"""Stage 4, vLLM: its process environment and engine arguments per platform, and the handle that
implements the run stage's `Engine` protocol on a real `LLMEngine`."""
