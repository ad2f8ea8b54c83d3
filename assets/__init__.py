"""The asset graph of one batch job: prompts -> prefix_groups -> completions (one partition per shard)."""

from .completions import build_completions
from .prefix_groups import build_prefix_groups
from .prompts import build_prompts

__all__ = ["build_prompts", "build_prefix_groups", "build_completions"]
