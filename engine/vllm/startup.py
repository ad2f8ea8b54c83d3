"""What vLLM's start-up spent its time on, and the state it started from.

A first start can take ten times a later one (86 s against 6-9 s, seen on a new user's first night)
for reasons nothing else records: the weights read from disk rather than the page cache, the
compiled code built rather than loaded from vLLM's compile cache, vLLM imported for the first time
in the process. ``StartupRecord`` times the phases this process sees and says which of those
states the start began from, so a slow start reads as a cause, not a mystery.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class StartupRecord:
    """Phases of one vLLM start (seconds) and where it started from."""

    weights_bytes: int = 0
    weights_in_page_cache: float | None = None  # 0..1 of the weight files' pages in memory before the start
    compile_cache_entries: int | None = None  # vLLM's compiled graphs on disk before the start (0: built now)
    phases: dict[str, float] = field(default_factory=dict)  # import, engine, choice_reads...
    compile_s: float | None = None  # of engine: compiling, as vLLM reports it (where its core shares our config)
    told: bool = field(default=False, repr=False)  # ``first_line`` said it already

    @classmethod
    def before_start(cls, model_path: str, cache_root: str | None, compiles: bool) -> "StartupRecord":
        """``compiles``: vLLM will compile the model (not eager): its compile cache matters."""
        weights = [p for p in Path(model_path).rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
        return cls(weights_bytes=sum(p.stat().st_size for p in weights),
                   weights_in_page_cache=page_cache_fraction(weights),
                   compile_cache_entries=compile_cache_entries(cache_root) if compiles else None)

    def timed(self, phase: str):
        """``with record.timed("engine"): ...`` adds the block's seconds to the phase."""
        return _Timed(self, phase)

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("told")
        out["phases"] = {name: round(s, 3) for name, s in self.phases.items()}
        out["total_s"] = round(self.total_s, 3)
        if self.weights_in_page_cache is not None:
            out["weights_in_page_cache"] = round(self.weights_in_page_cache, 3)
        if self.compile_s is not None:
            out["compile_s"] = round(self.compile_s, 3)
        return out

    def first_line(self) -> str | None:
        """``line()`` the first time it is asked; None after (an engine shared by several shards
        started once)."""
        if self.told:
            return None
        self.told = True
        return self.line()

    def line(self) -> str:
        """One line for the run's log: ``started in 86.0 s: import 9.1 s, engine 76.2 s (compile 40.3 s)...``"""
        phases = ", ".join(f"{name} {s:.1f} s" for name, s in self.phases.items())
        compiled = f" (compile {self.compile_s:.1f} s)" if self.compile_s else ""
        states = []
        if self.weights_in_page_cache is not None:
            size = (f"{self.weights_bytes / 2**30:.1f} GiB" if self.weights_bytes >= 2**30
                    else f"{self.weights_bytes / 2**20:.0f} MiB")
            states.append(f"weights {size}, {self.weights_in_page_cache:.0%} in the page cache before")
        if self.compile_cache_entries is not None:
            states.append("compile cache empty (compiled now; later starts load it)" if not self.compile_cache_entries
                          else f"compile cache had {self.compile_cache_entries} entries")
        said = f"vLLM started in {self.total_s:.1f} s: {phases}{compiled}"
        return f"{said}; {'; '.join(states)}" if states else said


class _Timed:
    def __init__(self, record: StartupRecord, phase: str):
        self.record, self.phase = record, phase

    def __enter__(self):
        self.started = time.perf_counter()

    def __exit__(self, *exc):
        self.record.phases[self.phase] = self.record.phases.get(self.phase, 0.0) + time.perf_counter() - self.started


def compile_cache_entries(cache_root: str | None) -> int | None:
    """Entries in vLLM's torch.compile cache (``VLLM_CACHE_ROOT/torch_compile_cache``), one per model
    and compile configuration; None where no cache root is known."""
    if not cache_root:
        return None
    folder = Path(cache_root) / "torch_compile_cache"
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def page_cache_fraction(paths: list[Path]) -> float | None:
    """The share of these files' pages the kernel holds in memory (``mincore``): near 0 means the
    weights are read from disk at start-up. None where it cannot be asked (not Linux, no files)."""
    import numpy as np

    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if not size:
            continue
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = np.zeros(pages, dtype=np.uint8)
        # A private mapping, never written: mapping reads nothing, and mincore reports the file's pages.
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
            start = ctypes.c_char.from_buffer(mapped)
            failed = mincore(ctypes.addressof(start), size, vector.ctypes.data)
            del start  # the mapping closes only once no pointer into it is left
        if failed:
            return None
        resident += int((vector & 1).sum())
        total += pages
    return resident / total if total else None

