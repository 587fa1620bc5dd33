"""The extraction workload of `structgen bench completion`: requests over three small strict schemas (a meeting
with attendees, a contact, an order with line items), prompts made from fixed word lists with a seeded generator,
so every run asks the same questions."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

MEETING = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "date": {"type": "string"},
        "attendees": {"type": "array", "items": {"type": "string"}},
        "room": {"type": "string"},
    },
    "required": ["title", "date", "attendees", "room"],
    "additionalProperties": False,
}
CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "phone": {"type": "string"},
        "company": {"type": "string"},
        "role": {"enum": ["engineer", "manager", "sales", "other"]},
    },
    "required": ["name", "email", "company", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"product": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["customer", "items", "express"],
    "additionalProperties": False,
}
NAMES = [
    "Amara",
    "Lukas",
    "Kai",
    "Sakura",
    "Mateo",
    "Ines",
    "Yusuf",
    "Freya",
    "Ravi",
    "Chloe",
    "Tomas",
    "Leila",
]
SURNAMES = [
    "Okafor",
    "Schmidt",
    "Tanaka",
    "Silva",
    "Novak",
    "Haddad",
    "Larsen",
    "Mehta",
    "Dubois",
    "Kowalski",
]
COMPANIES = ["Acme Robotics", "Bluewave Labs", "Northwind Foods", "Helios Energy", "Quartz Analytics"]
ROLES = ["software engineer", "engineering manager", "sales lead", "office assistant"]
PRODUCTS = ["USB-C cable", "standing desk", "monitor arm", "ergonomic chair", "laptop stand", "webcam"]
TOPICS = ["quarterly planning", "design review", "budget sync", "hiring committee", "launch retro"]
ROOMS = ["Aurora", "Room 4B", "the Lisbon office", "Zoom", "Meeting room 12"]
DAYS = ["Monday 3 March", "2026-04-14", "next Friday", "Tuesday the 9th", "June 21"]


@dataclass(frozen=True, slots=True)
class Extraction:
    id: str
    schema: dict[str, Any]
    messages: list[dict[str, Any]]


def extraction_requests(count: int, *, seed: int = 0) -> list[Extraction]:
    """`count` extraction prompts spread over the three schemas, made from the word lists above."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            people = rng.sample(NAMES, rng.randint(2, 6))
            text = (
                f"Notes: the {rng.choice(TOPICS)} is on {rng.choice(DAYS)} in {rng.choice(ROOMS)}. "
                f"Joining: {', '.join(people)}."
            )
            schema, what = MEETING, "the meeting (title, date, attendees, room)"
        elif kind == 1:
            first, last = rng.choice(NAMES), rng.choice(SURNAMES)
            company = rng.choice(COMPANIES)
            text = (
                f"Hi, I'm {first} {last}, {rng.choice(ROLES)} at {company}. Reach me at "
                f"{first.lower()}.{last.lower()}@{company.split()[0].lower()}.com or +1 555 01{rng.randint(10, 99)}."
            )
            schema, what = CONTACT, "the contact (name, email, phone, company, role)"
        else:
            lines = [f"{rng.randint(1, 5)} x {p}" for p in rng.sample(PRODUCTS, rng.randint(1, 4))]
            express = rng.choice(["Please ship express.", "Standard shipping is fine."])
            text = f"Order from {rng.choice(NAMES)} {rng.choice(SURNAMES)}: {'; '.join(lines)}. {express}"
            schema, what = ORDER, "the order (customer, items with product and quantity, express)"
        prompt = f"Extract {what} from this text as JSON.\n\n{text}"
        out.append(Extraction(f"extract-{i}", schema, [{"role": "user", "content": prompt}]))
    return out
