"""The runs a bench compares: each baseline (which prompts, which order, vLLM's prefix cache or
not) and this engine, and how the report names them."""

from __future__ import annotations

from dataclasses import dataclass


def input_order(prepared) -> list[int]:
    """The rows as the table has them: what plain vLLM gets."""
    return list(range(prepared.num_rows))


def sorted_order(prepared) -> list[int]:
    """The ``sorted()`` baseline: rows in lexicographic order of their token ids."""
    return sorted(range(prepared.num_rows), key=prepared.batch.row)


@dataclass(frozen=True)
class Run:
    """One run of the bench: the prompts it gets, the order a baseline feeds vLLM its rows in
    (None: this engine's scheduler), whether vLLM's prefix caching is on, and whether it is vLLM's
    own ``LLM.generate`` with vLLM's own batch sizes (the one line a user would otherwise write).

    Prompts: ``declared``, the table's prompts (from fields: in the declared order); ``chosen``,
    batchllm's own field order; ``hand``, the fields in one global order by ascending number of
    distinct values, what a user who knows prefix caching writes by hand. ``vllm_defaults``: at
    vLLM's own block size for the platform (128 on CPU, 16 on a GPU), the same KV memory, where
    the other runs take the engine's (32 on CPU). ``learned``: this engine with the answer lengths a
    night before learned (``plan.answer_lengths``: an untimed run of the same rows first)."""

    prompts: str
    order: object = None
    caching: bool = True
    generate: bool = False
    vllm_defaults: bool = False
    learned: bool = False


RUNS = {
    "vllm_nocache": Run("declared", input_order, caching=False),
    "vllm_apc": Run("declared", input_order),
    "vllm_apc_sorted": Run("declared", sorted_order),
    "vllm_generate_sorted": Run("declared", sorted_order, generate=True),
    "vllm_hand_order": Run("hand", sorted_order, generate=True),
    "vllm_hand_order_defaults": Run("hand", sorted_order, generate=True, vllm_defaults=True),
    "batchllm": Run("declared"),  # the engine on exactly the baselines' prompts
    "batchllm_field_order": Run("chosen"),  # the engine with its own field order
    "batchllm_learned": Run("declared", learned=True),  # the engine with a night before's answer lengths
}
ASKED_ONLY = ["batchllm_learned"]  # run where ``--runs`` names it: it costs a night before
ENGINE_RUNS = [name for name, run in RUNS.items() if run.order is None]
BASELINES = [name for name in RUNS if name not in ENGINE_RUNS]
FIELD_RUNS = [name for name, run in RUNS.items() if run.prompts != "declared"]  # prompts from fields only
LABELS = {"vllm_generate_sorted": "vLLM's LLM.generate on sorted rows", "vllm_apc_sorted": "vLLM on sorted rows",
          "vllm_apc": "vLLM with prefix caching", "vllm_nocache": "vLLM without it",
          "vllm_hand_order": "LLM.generate on sorted rows with fields by distinct values (by hand)",
          "vllm_hand_order_defaults": "the same by-hand recipe at vLLM's own block size (what a user meets)"}
ENGINE_LABELS = {"batchllm": "batchllm on the same prompts", "batchllm_field_order": "batchllm with its field order",
                 "batchllm_learned": "batchllm with the answer lengths a night before learned"}
