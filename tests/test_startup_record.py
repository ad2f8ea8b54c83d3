"""What a vLLM start spent its time on, and the state it started from (no vLLM here)."""
import os
import re
import time

from engine.vllm.startup import StartupRecord, compile_cache_entries, page_cache_fraction


def test_weights_read_from_disk_and_from_the_page_cache_are_told_apart(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(4 << 20))
    fd = os.open(weights, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # written pages are dirty: flushed first, they can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert page_cache_fraction([weights]) < 0.1  # a cold start reads them from disk
    finally:
        os.close(fd)
    weights.read_bytes()
    assert page_cache_fraction([weights]) == 1.0
    record = StartupRecord.before_start(str(tmp_path), None, compiles=False)
    assert record.weights_bytes == 4 << 20 and record.weights_in_page_cache == 1.0
    assert record.compile_cache_entries is None  # eager: no compile cache to speak of
    assert page_cache_fraction([]) is None


def test_an_empty_compile_cache_reads_as_a_start_that_compiles(tmp_path):
    assert compile_cache_entries(str(tmp_path)) == 0
    (tmp_path / "torch_compile_cache" / "abc123").mkdir(parents=True)
    assert compile_cache_entries(str(tmp_path)) == 1
    cold = StartupRecord.before_start(str(tmp_path), str(tmp_path / "elsewhere"), compiles=True)
    assert cold.compile_cache_entries == 0
    with cold.timed("import"):
        time.sleep(0.02)
    with cold.timed("engine"):
        time.sleep(0.03)
    cold.compile_s = 0.01
    line = cold.line()
    assert re.match(r"vLLM started in 0\.\d s: import 0\.0 s, engine 0\.0 s \(compile 0\.0 s\); ", line)
    assert "compile cache empty (compiled now; later starts load it)" in line
    assert cold.first_line() == line and cold.first_line() is None  # said once: a shared engine started once
    said = cold.to_dict()
    assert "told" not in said and 0.05 <= said["total_s"] < 1
    assert said["phases"]["engine"] >= 0.03 and said["compile_s"] == 0.01
