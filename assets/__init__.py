"""The asset graph of a batch job, built on ``batchllm_dagster``'s building blocks:
prompts -> prefix_groups -> completions (one partition per shard), its checks, jobs, sensors and
schedule (``build_batch_defs``), and the same from YAML (``BatchJobComponent``)."""

from .completions import build_completions
from .component import BatchJobComponent
from .factory import build_batch_defs
from .prefix_groups import build_prefix_groups
from .prompts import build_prompts

__all__ = ["BatchJobComponent", "build_batch_defs", "build_prompts", "build_prefix_groups", "build_completions"]
