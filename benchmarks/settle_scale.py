"""What settling a night's answered rows costs the plan step at scale (``plan_database.Checked.settle``): the
query that joins tonight's rows, the previous plan and the output table's export, and computes every
row's answer key in DuckDB. Synthetic tables of ROWS rows (every row answered, 1% edited), in the
plan's own database and memory limit; prints one JSON line (seconds, rows settled, peak RSS).

    PYTHONPATH=. python benchmarks/settle_scale.py --rows 10000000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _peak_rss() -> int:
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=1_000)
    rows, shards = parser.parse_args().rows, parser.parse_args().shards

    from engine.plan.answer_keys import key_sql
    from engine.plan.plan_database import Checked, PlanDatabase
    from engine.plan.plan_table import PlanRows

    fp = "0123456789abcdef"
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        database = PlanDatabase(work / "plan", 32)
        con = database.con
        con.execute(f"""CREATE TABLE row_ids AS SELECT i AS row, i AS id,
                            unhex(md5(i::VARCHAR))::BLOB AS key FROM range({rows}) t(i)""")
        con.execute(f"CREATE TABLE row_budgets AS SELECT i AS row, 0::BIGINT AS length, 16::BIGINT AS max_tokens "
                    f"FROM range({rows}) t(i)")
        per_shard = -(-rows // shards)
        con.execute(f"""COPY (SELECT id, row // {per_shard} AS shard, 'cpu-' || (row // {per_shard}) AS partition_key
                              FROM row_ids) TO '{work / "previous.parquet"}' (FORMAT parquet)""")
        # every row answered as planned, but 1% whose prompt changed since (their keys differ)
        answered = key_sql(fp, "CASE WHEN i.id % 100 = 0 THEN unhex(md5('edited')) ELSE i.key END", "16", "NULL",
                           "NULL")
        con.execute(f"""COPY (SELECT i.id, {answered} AS answer_key, 'ok' AS status,
                                     'cpu-' || (i.row // {per_shard}) AS partition_key FROM row_ids i)
                        TO '{work / "answers.parquet"}' (FORMAT parquet)""")
        started = time.perf_counter()
        settled = Checked(database, rows).settle(work / "previous.parquet", work / "answers.parquet", [fp],
                                                 PlanRows({}, {}))
        seconds = time.perf_counter() - started
        database.close()
    print(json.dumps({"rows": rows, "settled": settled, "settle_s": round(seconds, 2),
                      "process_peak_rss_bytes": _peak_rss()}))


if __name__ == "__main__":
    main()
