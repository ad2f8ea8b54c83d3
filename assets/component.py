"""``BatchJobComponent``: one batch job declared in a ``defs.yaml``.

    type: assets.BatchJobComponent
    attributes:
      name: reviews
      dataset:
        sql_file: reviews.sql          # relative to this folder
        database: batchllm.duckdb      # relative to BATCHLLM_DATA_DIR (default: the project's data/)
      llm: {model_path: smollm2}
      sampling: {max_tokens: 8}
      shards: 2
      hardware: [cpu]
      output_table: review_completions

It builds ``<name>/prompts`` -> ``<name>/prefix_groups`` -> ``<name>/completions``, their checks,
the nightly schedule and the sensors (see ``factory.build_batch_defs``).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import dagster as dg
from dagster.components.component_scaffolding import scaffold_component
from pydantic import Field

from batchllm_dagster.config import BatchJobConfig, JobSpec, default_data_dir
from batchllm_dagster.ownership import owns_answers_in

from .factory import build_batch_defs


class BatchJobScaffolder(dg.Scaffolder):
    """``dg scaffold defs assets.BatchJobComponent NAME``: a working example job."""

    def scaffold(self, request: dg.ScaffoldRequest) -> None:
        name = request.target_path.name.replace("-", "_")
        (request.target_path / "prompts.sql").write_text(
            "-- FILL IN: the batch, one row per prompt: a unique, non-NULL `id` and a `prompt` (text) or\n"
            "-- `messages` (JSON chat messages) column, optionally `max_tokens`. It runs read-only on the\n"
            "-- defs.yaml's `database` (a DuckDB file under BATCHLLM_DATA_DIR, default ./data); it may also\n"
            "-- read Parquet: SELECT id, prompt FROM read_parquet('my_prompts.parquet').\n"
            "SELECT id, prompt FROM my_prompt_table\n"
        )
        scaffold_component(request, {
            "name": name,
            "dataset": {"sql_file": "prompts.sql", "database": "my_warehouse.duckdb"},
            "llm": {"model_path": "smollm2"},
            "sampling": {"max_tokens": 32},
            "shards": 2,
            "hardware": ["cpu"],
            "output_table": f"{name}_completions",
        })
        written = request.target_path / "defs.yaml"
        written.write_text(
            "# FILL IN before `dg check defs`: dataset.database (a DuckDB file under BATCHLLM_DATA_DIR, default\n"
            "# ./data; or parquet: a file or glob instead of sql_file/database) and prompts.sql (your table);\n"
            "# llm.model_path (a local checkpoint, or a built-in: smollm2, tiny). Every key: `dg utils\n"
            "# inspect-component assets.BatchJobComponent`; the README's \"Declaring a batch job\".\n"
            + written.read_text())


@dg.scaffold_with(BatchJobScaffolder)
class BatchJobComponent(JobSpec, dg.Component, dg.Resolvable, dg.Model):
    """An offline LLM batch job over a SQL/Parquet prompt dataset, run by the batchllm engine on vLLM.

    Its fields are ``JobSpec``'s (the same model the Python factory takes); paths are relative to
    the component's folder (SQL files) or to the data directory (databases, Parquet, storage)."""

    output_database: str | None = Field(
        None, description="DuckDB database the answers go to, under the data directory (default: the package's "
        "own <storage_dir>/answers.duckdb; the dataset's database only when you name it here)")
    storage_dir: str | None = Field(None, description="default: <data>/jobs")

    @classmethod
    def get_model_cls(cls):
        """Dagster's model of the YAML, its JSON schema sharpened for ``dg check defs`` (``_precise``)."""
        return _with_precise_schema(super().get_model_cls())

    def to_config(self, component_dir: Path, project_root: Path | None = None) -> BatchJobConfig:
        """The job, its relative paths resolved: the SQL file against its folder, the rest against the
        data directory (``default_data_dir``: of ``project_root`` where given, whatever folder the
        command ran from)."""
        data = default_data_dir(project_root)
        resolved = self.dataset.resolved(self.name, component_dir, data)
        shared = {name: getattr(self, name) for name in JobSpec.model_fields}
        storage = data / self.storage_dir if self.storage_dir else data / "jobs"
        return BatchJobConfig(**{**shared, "dataset": resolved}, storage_dir=str(storage),
                              output_database=self._output_database(data, storage, resolved.database))

    def _output_database(self, data: Path, storage: Path, source_database: str | None) -> str:
        """The database named, else the package's own beside the job's files: a database of the user's
        is written only when named. Answers an older version put in the dataset's database by default
        stay there (moving the default must not answer every row again), with a warning saying so."""
        if self.output_database:
            return str(data / self.output_database)
        default = storage / "answers.duckdb"
        if not source_database or not Path(source_database).is_file() or (
                default.is_file() and owns_answers_in(self.name, self.output_table, str(default))):
            return str(default)
        named = self.dataset.database  # as the YAML names it, relative to the data directory
        legacy = owns_answers_in(self.name, self.output_table, source_database)
        if legacy is None:  # guessing wrong would answer every row again, or write the user's database
            raise ValueError(f"job {self.name!r}: cannot tell whether its answers are in the dataset's database "
                             f"{source_database} (the default of earlier versions): another process holds it. Set "
                             f"output_database: {named} to keep them there, or "
                             f"{default.relative_to(data) if default.is_relative_to(data) else default} for the "
                             "package's own database")
        if legacy:
            warnings.warn(
                f"job {self.name!r}: its answers are in the dataset's database {source_database} (the default of "
                f"earlier versions) and stay there; set output_database: {named} to say so, or move table "
                f"{self.output_table!r} to {storage / 'answers.duckdb'}", stacklevel=2)
            return source_database
        return str(default)

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        # `dg launch` from a subfolder of the project must find the job's files and models where the
        # project keeps them, not start a second copy under that folder.
        root = Path(context.project_root)
        os.environ.setdefault("BATCHLLM_CACHE_DIR", str(root / ".cache"))
        return build_batch_defs(self.to_config(Path(context.path), root))


@functools.cache
def _with_precise_schema(model: type) -> type:
    class PreciseSchema(model):
        @classmethod
        def model_json_schema(cls, *args, **kwargs) -> dict:
            return _precise(super().model_json_schema(*args, **kwargs))

    PreciseSchema.__name__ = PreciseSchema.__qualname__ = model.__name__
    return PreciseSchema


def _precise(schema: dict) -> dict:
    """``dg check defs`` validates a defs.yaml against the JSON schema and prints each error's own
    message. A nested settings block is ``anyOf [its model, a template string]`` (or ``[model,
    null]``), and a misspelled key in it says only "is not valid under any of the given schemas".
    Here each such block is its model inlined, null allowed where it was: the error then names the
    key ("Additional properties are not allowed ('score_choice' was unexpected)"). A whole block
    as one template string is given up; templates inside a block still work."""
    defs = schema.get("$defs", {})

    def sharpen(properties: dict) -> None:
        for name, prop in properties.items():
            options = prop.get("anyOf", [])
            refs = [o["$ref"] for o in options if "$ref" in o]
            if len(refs) != 1 or any("$ref" not in o and o not in ({"type": "string"}, {"type": "null"})
                                     for o in options):
                continue
            model = defs.get(refs[0].rsplit("/", 1)[-1], {})
            if model.get("type") != "object":
                continue  # an enum's model (backend): a string is what it is
            inlined = {key: value for key, value in prop.items() if key != "anyOf"}
            inlined.update({key: value for key, value in model.items() if key not in ("title", "description")})
            inlined["type"] = ["object", "null"] if {"type": "null"} in options else "object"
            properties[name] = inlined

    sharpen(schema.get("properties", {}))
    for model in defs.values():
        sharpen(model.get("properties", {}))
    return schema
