"""Extract structured data from text into a Pydantic model with structgen's typed client.

structgen serve &                    # or any OpenAI-compatible server
python examples/extract.py --text "Maria is 34 years old and lives in Lisbon, Portugal."
"""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import BaseModel, Field

from structgen.client import Client, ClientError


class Address(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=130)
    address: Address


def main() -> int:
    parser = argparse.ArgumentParser(description="Extract a person from text as a typed object.")
    parser.add_argument("--base-url", default=os.environ.get("STRUCTGEN_BASE_URL"), help="server root URL")
    parser.add_argument("--text", default="Maria is 34 years old and lives in Lisbon, Portugal.")
    args = parser.parse_args()
    with Client(args.base_url) as client:
        try:
            person = client.parse(
                Person,
                messages=[
                    {"role": "system", "content": "Extract the person described by the user as JSON."},
                    {"role": "user", "content": args.text},
                ],
                temperature=0,
                max_tokens=80,
            )
        except ClientError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    print(f"{person.name}, {person.age}, from {person.address.city} ({person.address.country})")
    print(person.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
