"""Regex-constrained answers: an ISO date and a US phone number (embedded SmolLM2, offline).

    python examples/regex_dates_phones.py

The regex is a full match: generation stops exactly when the text is complete.
"""

import re

from grammar_mlx import default_model
from grammar_mlx.generate import generate_regex

ISO_DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
US_PHONE = r"\([2-9][0-9]{2}\) [0-9]{3}-[0-9]{4}"


def main() -> None:
    model, tokenizer = default_model()
    date = generate_regex(model, tokenizer, "On what date did Apollo 11 land on the Moon? Answer as YYYY-MM-DD.",
                          ISO_DATE, max_tokens=16)
    phone = generate_regex(model, tokenizer, "Give a phone number for a pizza place in New York.",
                           US_PHONE, max_tokens=20)
    assert re.fullmatch(ISO_DATE, date) and re.fullmatch(US_PHONE, phone)
    print(f"date:  {date}")
    print(f"phone: {phone}")


if __name__ == "__main__":
    main()
