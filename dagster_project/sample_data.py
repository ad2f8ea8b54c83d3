"""The demo's embedded DuckDB database, generated from a fixed seed (nothing large in git).

Prompt tables, each with the prefix shape of a real batch job:
* ``review_labels``: one long instruction + few-shot block shared by every row (classification);
* ``document_questions``: several questions asked about each of many documents (chat rows, a
  system prompt shared by all, a document shared by its questions: nested prefixes);
* ``support_replies``: chat rows sharing a support-agent system prompt, each with its own ticket;
* ``customers`` and ``support_tickets``: a relational pair, joined by the ``tickets`` job, whose
  prompt is built from the join's fields (each customer has 1-3 tickets: many small groups).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa

from engine.atomic import Staged

SEED = 20241203

_PRODUCTS = ["headphones", "coffee grinder", "desk lamp", "running shoes", "backpack", "phone case",
             "air fryer", "keyboard", "water bottle", "office chair", "blender", "e-reader"]
_GOOD = ["works perfectly", "exceeded my expectations", "is worth every penny", "arrived quickly and works great",
         "feels solid and well made", "is the best purchase I made this year"]
_BAD = ["broke after two days", "is much smaller than pictured", "stopped working within a week",
        "arrived damaged", "is loud and cheaply made", "was a waste of money"]
_MEH = ["is fine for the price", "does the job but nothing special", "is okay, the color is a bit off",
        "works, although setup took a while"]

_REVIEW_INSTRUCTIONS = """You are a careful annotator for an online store. Read the customer review and label its
sentiment as exactly one word: positive, negative or neutral. A review is positive when the customer is
satisfied with the product, negative when the customer reports a defect, a delay or disappointment, and
neutral when the review is mixed or only factual. Answer with the label only.

Review: The blender is powerful and crushes ice in seconds.
Label: positive

Review: The lamp flickers constantly and the switch broke on day one.
Label: negative

Review: The backpack is fine for the price, nothing more.
Label: neutral

Review: These shoes are comfortable and the delivery was fast.
Label: positive

"""

_TOPICS = [
    ("Solar panels", "convert sunlight into electricity using photovoltaic cells made of silicon"),
    ("The Roman aqueducts", "carried water across long distances using gravity and carefully built arches"),
    ("Honeybees", "communicate the location of flowers to their hive mates through a waggle dance"),
    ("Vaccines", "train the immune system to recognize a pathogen without causing the disease"),
    ("Coral reefs", "are built by tiny animals called polyps that secrete calcium carbonate skeletons"),
    ("The printing press", "made books cheaper and spread literacy across Europe in the fifteenth century"),
    ("Black holes", "are regions of space where gravity is so strong that not even light can escape"),
    ("Photosynthesis", "lets plants turn carbon dioxide and water into sugar using the energy of light"),
    ("The Silk Road", "was a network of trade routes linking China with the Mediterranean world"),
    ("Volcanoes", "form where molten rock from inside the Earth reaches the surface"),
    ("Compound interest", "means that interest is earned on previously earned interest as well as on the principal"),
    ("The water cycle", "moves water between oceans, the atmosphere and land through evaporation and rain"),
    ("Glaciers", "are slow rivers of ice that carve valleys as they move downhill"),
    ("Electric cars", "store energy in batteries and use electric motors instead of combustion engines"),
    ("The human heart", "pumps blood through the body with four chambers and a set of one-way valves"),
    ("Tides", "are caused mainly by the gravitational pull of the Moon on the Earth's oceans"),
    ("Antibiotics", "kill bacteria or stop them from growing but do not work against viruses"),
    ("Earthquakes", "happen when stress built up along faults in the Earth's crust is suddenly released"),
    ("The internet", "is a global network of computers that exchange data using shared protocols"),
    ("Rainforests", "hold more than half of the world's plant and animal species"),
]
_QUESTIONS = ["Summarize the document in one sentence.", "What is the main idea?",
              "Give one fact from the document.", "Who would find this document useful?",
              "Write a question a student could answer after reading it."]

_SUPPORT_SYSTEM = """You are a friendly support agent for Acme Cloud Storage. Be concise and polite. Our plans:
Free (5 GB), Plus (200 GB, 3 dollars a month) and Pro (2 TB, 10 dollars a month). Refunds are possible within
30 days of payment. Files in the trash are deleted after 30 days. Two-factor authentication can be turned on
under Settings, Security. Sync problems are usually fixed by signing out and in again on the desktop app."""
_TICKETS = ["How do I turn on two-factor authentication?", "Can I get a refund for last month?",
            "My files are not syncing on my laptop.", "What does the Plus plan cost?",
            "I deleted a folder by mistake, can I get it back?", "How much space does the Pro plan have?",
            "How do I cancel my subscription?", "Is there a student discount?"]


def _document(topic: str, fact: str, rng: random.Random) -> str:
    sentences = [
        f"{topic} {fact}.",
        f"Scientists and historians have studied {topic.lower()} for a long time.",
        f"Many people learn about {topic.lower()} at school, yet few know the details.",
        f"One reason {topic.lower()} matter is that they shape daily life in ways that are easy to miss.",
        f"Recent work has added new measurements and new questions about {topic.lower()}.",
    ]
    rng.shuffle(sentences[1:])
    return " ".join(sentences)


def review_labels(rng: random.Random, rows: int = 120) -> pa.Table:
    ids, prompts, max_tokens = [], [], []
    for i in range(rows):
        product = rng.choice(_PRODUCTS)
        phrase = rng.choice(rng.choice([_GOOD, _BAD, _MEH]))
        ids.append(f"review-{i:04d}")
        prompts.append(f"{_REVIEW_INSTRUCTIONS}Review: The {product} {phrase}.\nLabel:")
        max_tokens.append(4)
    return pa.table({"id": ids, "prompt": prompts, "max_tokens": pa.array(max_tokens, pa.int32())})


def document_questions(rng: random.Random) -> pa.Table:
    ids, messages = [], []
    system = {"role": "system", "content": "You answer questions about the document the user gives. Be brief."}
    for d, (topic, fact) in enumerate(_TOPICS):
        document = _document(topic, fact, rng)
        for q, question in enumerate(_QUESTIONS):
            ids.append(f"doc-{d:02d}-q{q}")
            user = {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {question}"}
            messages.append(json.dumps([system, user]))
    return pa.table({"id": ids, "messages": messages})


def support_replies(rng: random.Random, rows: int = 80) -> pa.Table:
    ids, messages = [], []
    for i in range(rows):
        name = rng.choice(["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"])
        ticket = f"Hi, this is {name}. {rng.choice(_TICKETS)}"
        ids.append(f"ticket-{i:04d}")
        messages.append(
            json.dumps([{"role": "system", "content": _SUPPORT_SYSTEM}, {"role": "user", "content": ticket}])
        )
    return pa.table({"id": ids, "messages": messages})


_PLANS, _REGIONS, _PRIORITIES = (
    ["basic", "plus", "pro"],
    ["north", "south", "east", "west"],
    ["low", "normal", "urgent"],
)
_BUSINESSES = ["bakery", "law firm", "design studio", "dental clinic", "bike shop", "school", "hotel", "garage"]


def customers_and_tickets(rng: random.Random, customers: int = 24) -> tuple[pa.Table, pa.Table]:
    """Customers (a plan, a region, a short profile) and their 1-3 support tickets each."""
    rows, tickets = [], []
    for c in range(customers):
        business = rng.choice(_BUSINESSES)
        profile = (f"A {business} with {rng.randint(2, 60)} staff, a customer since {rng.randint(2015, 2024)}, "
                   f"who stores {rng.choice(['invoices', 'photos', 'contracts', 'course material', 'drawings'])} "
                   f"and shares them with {rng.choice(['clients', 'a partner office', 'students', 'suppliers'])}.")
        rows.append((f"customer-{c:03d}", f"{rng.choice(['Ana', 'Ben', 'Chen', 'Dara'])} at the {business}", profile,
                     rng.choice(_PLANS), rng.choice(_REGIONS)))
        for _ in range(rng.randint(1, 3)):
            tickets.append((f"ticket-{len(tickets):04d}", f"customer-{c:03d}", rng.choice(_TICKETS),
                            rng.choice(_PRIORITIES)))
    customer_table = pa.table(dict(zip(["customer_id", "name", "profile", "plan", "region"], zip(*rows))))
    ticket_table = pa.table(dict(zip(["id", "customer_id", "subject", "priority"], zip(*tickets))))
    return customer_table, ticket_table


def _tables(rng: random.Random) -> dict[str, pa.Table]:
    """Every table, generated in a fixed order from one seeded generator (a new table goes last,
    so the others stay the same)."""
    tables = {"review_labels": review_labels(rng), "document_questions": document_questions(rng),
              "support_replies": support_replies(rng)}
    tables["customers"], tables["support_tickets"] = customers_and_tickets(rng)
    return tables


def build_sample_database(path: str | Path, rebuild: bool = False) -> Path:
    """Create the demo database with its prompt tables; an existing one gets the tables it lacks
    (a database made by an earlier version), its other tables and answers untouched."""
    import duckdb

    path = Path(path)
    tables = _tables(random.Random(SEED))
    if path.exists() and not rebuild:
        with duckdb.connect(str(path)) as con:
            present = {name for (name,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
            for name, table in tables.items():
                if name not in present:
                    con.register("incoming", table)
                    con.execute(f"CREATE TABLE {name} AS SELECT * FROM incoming")
                    con.unregister("incoming")
        return path
    with Staged(path) as staged, duckdb.connect(str(staged.path)) as con:
        for name, table in tables.items():
            con.register("incoming", table)
            con.execute(f"CREATE TABLE {name} AS SELECT * FROM incoming")
            con.unregister("incoming")
    return path


if __name__ == "__main__":
    import sys

    print(build_sample_database(sys.argv[1] if len(sys.argv) > 1 else "data/batchllm.duckdb", rebuild=True))
