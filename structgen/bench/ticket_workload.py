"""Support tickets to extract: the second workload of `structgen bench speculative`.

`extraction_workload` asks for short values (a first name, a room); real extraction also copies long spans
verbatim: order numbers, street addresses, a product's full name, the sentence that states the problem. Each
ticket here is a short email made from fixed word lists with a seeded generator (every run asks the same
questions), and the schema asks for those spans as they appear.
"""

from __future__ import annotations

import random

from structgen.bench.extraction_workload import COMPANIES, NAMES, SURNAMES, Extraction

TICKET = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "email": {"type": "string"},
        "order_id": {"type": "string"},
        "product": {"type": "string"},
        "shipping_address": {"type": "string"},
        "problem": {"type": "string"},
        "urgent": {"type": "boolean"},
    },
    "required": ["customer", "email", "order_id", "product", "shipping_address", "problem", "urgent"],
    "additionalProperties": False,
}
PRODUCTS = [
    "Aeron ergonomic office chair (graphite, size B)",
    "UltraSharp 27-inch 4K USB-C monitor U2723QE",
    "Logitech MX Master 3S wireless performance mouse",
    "Bose QuietComfort 45 noise-cancelling headphones",
    "Standing desk frame with dual motors, 160 x 80 cm oak top",
]
STREETS = ["221B Baker Street", "1600 Amphitheatre Parkway", "10 Downing Street", "742 Evergreen Terrace"]
CITIES = ["London NW1 6XE", "Mountain View, CA 94043", "Springfield, OR 97403", "Lisbon 1100-148"]
PROBLEMS = [
    "The package arrived with a cracked base and one of the wheels missing.",
    "The screen shows a flickering green line along the left edge after ten minutes of use.",
    "The item was delivered to the wrong address and the tracking page still says in transit.",
    "I was charged twice for the same order and only one item was delivered.",
    "The left earcup stopped working after the latest firmware update.",
]


def ticket_requests(count: int, *, seed: int = 0) -> list[Extraction]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        first, last = rng.choice(NAMES), rng.choice(SURNAMES)
        company = rng.choice(COMPANIES)
        order = f"ORD-{rng.randint(2024, 2026)}-{rng.randint(100000, 999999)}-{rng.choice('ABCDEFGH')}"
        urgent = rng.random() < 0.5
        text = (
            f"From: {first} {last} <{first.lower()}.{last.lower()}@{company.split()[0].lower()}.com>\n"
            f"Subject: Problem with order {order}\n\n"
            f"Hello, I ordered the {rng.choice(PRODUCTS)} for delivery to {rng.choice(STREETS)}, "
            f"{rng.choice(CITIES)}. {rng.choice(PROBLEMS)} "
            + ("Please treat this as urgent, we need it this week." if urgent else "No rush, thank you.")
            + f"\n\nBest regards,\n{first} {last}, {company}"
        )
        prompt = (
            "Extract the ticket as JSON: customer, email, order_id, product, shipping_address, problem (the "
            f"sentence stating it), urgent.\n\n{text}"
        )
        out.append(Extraction(f"ticket-{i}", TICKET, [{"role": "user", "content": prompt}]))
    return out
