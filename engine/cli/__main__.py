"""``python -m engine.cli``: the same as ``batchllm``."""

import sys

from .main import main

sys.exit(main())
