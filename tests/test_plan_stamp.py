"""What a plan was made from (its stamp): a change to any of it makes the plan stale."""

import pyarrow as pa

from engine.settings import fingerprint


def test_a_changed_chat_template_or_snapshot_makes_the_plan_stale(tmp_path, tiny_model):
    import json
    import shutil

    import pyarrow.parquet as pq

    from batchllm_dagster.config import BatchJobConfig, DatasetSpec
    from batchllm_dagster.job_settings import JobSettings
    from engine.plan.plan_stamp import stale_reasons
    from engine.settings import EngineSettings

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = BatchJobConfig(name="j", dataset=DatasetSpec(parquet=str(tmp_path / "p.parquet")),
                            llm=EngineSettings(model_path=str(model)), output_database=str(tmp_path / "o.duckdb"),
                            storage_dir=str(tmp_path / "jobs"))
    config.files.prompts_path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), config.files.prompts_path)
    resolved = JobSettings(config)
    stamp = resolved.stamp(resolved.engine())
    recorded = {k.encode(): v.encode() for k, v in stamp.items()}
    assert stale_reasons(recorded, resolved.stamp(resolved.engine())) == []

    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{{ messages[0]['content'] }}"
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    assert stale_reasons(recorded, resolved.stamp(resolved.engine())) == [
        "the model, tokenizer or chat template"
    ]

    pq.write_table(pa.table({"id": [1], "prompt": ["b"]}), config.files.prompts_path)
    assert "the prompt snapshot" in stale_reasons(recorded, resolved.stamp(resolved.engine()))
    assert stale_reasons(None, stamp)  # a plan without a stamp is stale too


def test_every_setting_that_shapes_a_plan_makes_it_stale_and_changes_the_plan_asset_code_version():
    """One list of the settings that shape a plan (``PlanShaping``): each of them, changed, changes
    the stamp a plan records and the plan asset's code version; a sampling setting that does not
    shape the plan changes neither. The stamp's value is pinned: a changed formula would make every
    plan on disk stale at once."""
    from batchllm_dagster.config import BatchJobConfig, DatasetSpec
    from engine.plan.plan_stamp import PlanShaping
    from engine.settings import EngineSettings, SamplingSettings, SchedulerSettings
    from engine.table.dataset import Columns

    llm = EngineSettings(model_path="/m", max_model_len=512)
    base = PlanShaping.of(llm, SamplingSettings(max_tokens=8), SchedulerSettings(), Columns())
    assert base.fingerprint() == fingerprint(32, 512, 8, 2, Columns())  # the formula plans on disk were stamped with
    changed = {
        "block_size": PlanShaping.of(llm.model_copy(update={"block_size": 16}), SamplingSettings(max_tokens=8),
                                     SchedulerSettings(), Columns()),
        "context_len": PlanShaping.of(llm.model_copy(update={"max_model_len": 256}), SamplingSettings(max_tokens=8),
                                      SchedulerSettings(), Columns()),
        "max_tokens": PlanShaping.of(llm, SamplingSettings(max_tokens=9), SchedulerSettings(), Columns()),
        "min_group_rows": PlanShaping.of(llm, SamplingSettings(max_tokens=8), SchedulerSettings(min_group_rows=3),
                                         Columns()),
        "columns": PlanShaping.of(llm, SamplingSettings(max_tokens=8), SchedulerSettings(), Columns(prompt="text")),
        "response_format": PlanShaping.of(llm, SamplingSettings(max_tokens=8, response_format={"choice": ["a", "b"]}),
                                          SchedulerSettings(), Columns()),
        "score_choices": PlanShaping.of(llm, SamplingSettings(max_tokens=8, score_choices=True), SchedulerSettings(),
                                        Columns()),
    }
    assert set(changed) == {f for f in PlanShaping.__dataclass_fields__}
    assert all(s.fingerprint() != base.fingerprint() for s in changed.values())

    def job(**update):
        fields = {"name": "j", "dataset": DatasetSpec(parquet="p.parquet"), "llm": llm, "output_database": "o.duckdb",
                  "storage_dir": "jobs", "sampling": SamplingSettings(max_tokens=8), **update}
        return BatchJobConfig(**fields)

    version = job().plan_code_version()
    assert job(scheduler=SchedulerSettings(min_group_rows=3)).plan_code_version() != version
    assert job(sampling=SamplingSettings(max_tokens=9)).plan_code_version() != version
    assert job(dataset=DatasetSpec(parquet="p.parquet", prompt_column="text")).plan_code_version() != version
    assert job(sampling=SamplingSettings(max_tokens=8, temperature=0.7)).plan_code_version() == version
    choice = SamplingSettings(max_tokens=8, response_format={"choice": ["a", "b"]})
    assert job(sampling=choice).plan_code_version() != version
    scored = SamplingSettings(max_tokens=8, response_format={"choice": ["a", "b"]}, score_choices=True)
    assert job(sampling=scored).plan_code_version() != job(sampling=choice).plan_code_version()
