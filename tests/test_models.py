"""The built-in offline models."""


def test_a_built_in_model_prepared_on_first_use_is_announced_with_where_it_goes(tmp_path, monkeypatch):
    from engine import models

    monkeypatch.setenv("BATCHLLM_CACHE_DIR", str(tmp_path))
    notice = models.preparation_notice("smollm2")
    assert f"into {tmp_path / 'models' / 'smollm2'}" in notice and "about 0.5 GB" in notice
    assert "batchllm prepare-model" in notice
    (tmp_path / "models" / "smollm2").mkdir(parents=True)
    models._mark_prepared(tmp_path / "models" / "smollm2", name="x")
    assert models.preparation_notice("smollm2") is None  # prepared: nothing to say
    assert models.preparation_notice(str(tmp_path)) is None  # a checkpoint of one's own: nothing to prepare
