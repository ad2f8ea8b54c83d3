"""A job's declaration read from its YAML without Dagster: a Component's ``defs.yaml`` (its
``attributes:``) or the factory's fields alone. ``batchllm plan --job`` plans what it declares (the
dataset, its prompt fields, the model, sampling and choices, the shards) and ``batchllm doctor --job``
checks its engine settings, each read by the model the Dagster job reads it with: a key the job would
refuse is refused here too. Keys of the Dagster job alone (hardware, schedule, output table) are left
to it. Paths resolve as the Component resolves them (``DatasetSpec.resolved``): the SQL file against
the YAML's folder, the rest against the project's data folder."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..settings import EngineSettings, SamplingSettings
from ..table.dataset_spec import DatasetSpec, default_data_dir, project_root


@dataclass(frozen=True)
class JobFile:
    path: Path
    attributes: dict

    @classmethod
    def read(cls, path: str | Path) -> "JobFile":
        import yaml

        path = Path(path)
        document = yaml.safe_load(path.read_text())
        attributes = document.get("attributes", document) if isinstance(document, dict) else None
        if not isinstance(attributes, dict):
            raise ValueError(f"{path} is not a job's YAML: a mapping of its settings (a defs.yaml's attributes:)")
        return cls(path, attributes)

    @property
    def name(self) -> str:
        return str(self.attributes.get("name", self.path.parent.name))

    def llm(self) -> EngineSettings:
        """Its engine settings as declared (the platform's defaults unfilled)."""
        return EngineSettings(**self.attributes.get("llm", {}))

    def sampling(self) -> SamplingSettings:
        return SamplingSettings(**self.attributes.get("sampling", {}))

    def dataset(self) -> DatasetSpec:
        """Its dataset, the paths resolved in its project's data folder."""
        if "dataset" not in self.attributes:
            raise ValueError(f"{self.path} declares no dataset:")
        root, _ = project_root(self.path.parent)
        return DatasetSpec(**self.attributes["dataset"]).resolved(self.name, self.path.parent.resolve(),
                                                                  default_data_dir(root))

    def shards_for(self, rows: int) -> int | None:
        """The shards it declares for ``rows`` rows (``shards`` or ``rows_per_shard``); None where the
        Dagster job sizes them from the nights it measured."""
        if self.attributes.get("shards"):
            return int(self.attributes["shards"])
        per_shard = self.attributes.get("rows_per_shard")
        return max(1, math.ceil(rows / int(per_shard))) if per_shard else None
