"""Where the libraries' own output goes: vLLM's, torch's and the others' log records and warnings
(a missing Triton, a deprecated torch API, NUMA binding) to a log file, only their errors to the
console. vLLM's share is set through its environment (``VLLM_LOGGING_CONFIG_PATH``), which is why
this lives in the vllm stage."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path

from ..machine import CACHE_ROOT

# Libraries whose log records and warnings are about their own internals (a missing Triton, a
# deprecated torch API, NUMA binding): kept in the log file, only their errors reach the console.
THIRD_PARTY_LOGGERS = ("vllm", "torch", "transformers", "tokenizers", "xgrammar", "llguidance", "filelock",
                       "urllib3", "ray", "alembic", "huggingface_hub", "accelerate")


LOG_DIR = CACHE_ROOT / "logs"
# The process name tells the engine core's lines (its own process on a GPU) from the run's.
LOG_FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(name)s: %(message)s"
_to_file: logging.Handler | None = None
_routed: list[logging.Handler] = []  # a library's top logger's handlers: the file, and errors to the console


def route_library_output(log_file: Path) -> Path:
    """Send the libraries' warnings and log records to ``log_file`` (call before importing vLLM).
    Returns the file's path."""
    global _to_file
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(log_file)
    to_file.setFormatter(logging.Formatter(LOG_FORMAT))
    _to_file = to_file
    errors = logging.StreamHandler(sys.stderr)
    errors.setLevel(logging.ERROR)
    # vLLM configures its loggers itself, in this process and in the engine core it spawns on a GPU
    # (which inherits our environment, not our handlers): given this file's configuration, its INFO
    # lines (attention backend, KV cache size, compile and CUDA graph times) land in the log file
    # from every process, and only its errors reach the console. torch's C++ side prints warnings
    # straight to stderr unless its level is raised.
    if os.environ.get("VLLM_CONFIGURE_LOGGING") != "0" and "VLLM_LOGGING_CONFIG_PATH" not in os.environ:
        os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(_vllm_logging_config(log_file))
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    global _routed
    _routed = [to_file, errors]
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if name == "vllm" else logging.WARNING)  # vLLM's start-up
    tidy_library_loggers()
    logging.captureWarnings(True)  # warnings.warn(...) -> the "py.warnings" logger
    py_warnings = logging.getLogger("py.warnings")
    py_warnings.handlers[:] = [to_file]
    py_warnings.propagate = False
    warnings.simplefilter("default")
    return log_file


@contextlib.contextmanager
def library_output_routed(log_file: Path):
    """``route_library_output`` for a block of a process that is not ours alone (a Dagster run's
    step, a test): the libraries' lines go to ``log_file`` while it runs, and every logger,
    environment variable and warnings filter it touched is as it was afterwards. Where output is
    routed already (the CLI, the demo) it changes nothing. Yields the log file in use."""
    global _to_file
    if _to_file is not None:
        yield Path(_to_file.baseFilename)
        return
    names = [*THIRD_PARTY_LOGGERS, "py.warnings"]
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate,
                    logging.getLogger(name).level) for name in names}
    env = {key: os.environ.get(key) for key in ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH",
                                                "TORCH_CPP_LOG_LEVEL")}
    with warnings.catch_warnings():
        try:
            yield route_library_output(log_file)
        finally:
            logging.captureWarnings(False)
            if _to_file is not None:
                _to_file.close()
            _to_file = None
            for name, (handlers, propagate, level) in saved.items():
                logger = logging.getLogger(name)
                for added in set(logger.handlers) - set(handlers):  # vLLM's own file handler, if it came
                    added.close()
                logger.handlers[:], logger.propagate = handlers, propagate
                logger.setLevel(level)
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _vllm_logging_config(log_file: Path) -> Path:
    """vLLM's logging configuration (``VLLM_LOGGING_CONFIG_PATH``, a ``dictConfig``): its loggers to
    ``log_file`` and errors to stderr, other loggers left alone; written beside the log file."""
    import json

    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": LOG_FORMAT}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file), "formatter": "plain"},
                     "errors": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR",
                                "formatter": "plain"}},
        "loggers": {"vllm": {"handlers": ["file", "errors"], "level": "INFO", "propagate": False}},
    }
    path = log_file.with_name(log_file.stem + ".vllm-logging.json")
    path.write_text(json.dumps(config, indent=1))
    return path


def tidy_library_loggers() -> None:
    """Torch gives its loggers stderr handlers of its own when it is imported (its top ``torch``
    logger's prints a missing Triton to the console): once output is routed
    (``route_library_output``), give each library's top logger the routed handlers again and send its
    sub-loggers through it. Called after torch and vLLM are imported."""
    if _to_file is None:
        return
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or name.split(".")[0] not in THIRD_PARTY_LOGGERS:
            continue
        top = "." not in name
        logger.handlers[:] = _routed if top else []
        logger.propagate = not top
    for name in THIRD_PARTY_LOGGERS:  # one not made yet
        logging.getLogger(name).handlers[:], logging.getLogger(name).propagate = _routed, False


def import_torch() -> None:
    """Import torch and route its loggers again: its import gives them console handlers of their own."""
    import torch  # noqa: F401

    tidy_library_loggers()


def file_logger(name: str) -> logging.Logger:
    """A logger that writes to the log file only (progress lines while a bar is on screen)."""
    logger = logging.getLogger(name)
    if _to_file is not None:
        logger.handlers[:] = [_to_file]
        logger.propagate = False
    return logger
