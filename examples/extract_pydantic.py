"""Extract a Pydantic model from text with the embedded SmolLM2 (offline, CPU is fine).

    python examples/extract_pydantic.py

The Pydantic class is the schema: its JSON Schema is compiled into a token-level grammar, the model
can only produce JSON that fits it, and the result comes back as an instance of the class.
"""

from typing import Literal

from pydantic import BaseModel, Field

from grammar_mlx import default_model
from grammar_mlx.generate import generate_structured


class Contact(BaseModel):
    name: str = Field(min_length=1, max_length=20)
    company: str = Field(min_length=1, max_length=16)
    team: Literal["sales", "engineering", "support", "other"]
    years: int = Field(ge=0, le=50)


EMAIL = "Hi, I'm Maria Lopez. I lead the sales team at Acme and have been here 7 years."


def main() -> None:
    model, tokenizer = default_model()
    out = generate_structured(
        model, tokenizer, f"Extract the sender as JSON.\n\n{EMAIL}", schema=Contact, max_tokens=64)
    contact = out.value
    assert isinstance(contact, Contact)
    print(repr(contact))
    print(out.stats.summary())


if __name__ == "__main__":
    main()
