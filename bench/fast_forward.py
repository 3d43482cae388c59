"""Grammar fast-forward with SmolLM2-135M on this machine: is constrained output faster than plain?

Schema-heavy cases (many long keys, enums, booleans, nested objects: the text a grammar forces),
each a chat request whose prompt holds the answer. Per case, in one run, back to back:
  constrained      `generate_structured(..., fast_forward=False)`: one decode step per token
  canonical        `fast_forward="canonical"`: forced text as canonical tokens, unverified
  verified         `fast_forward="verified"`: forced tokens proposed, kept where the model agrees
  unconstrained    mlx-lm's `stream_generate` with no grammar, at the constrained output's length
                   (its one processor masks EOS off, so it writes exactly as many tokens)
Each case states its answer in the prompt; besides agreement with constrained greedy's object, the
bench counts the fields each mode got right (free text not scored). Wall time (and CPU time, which
other load on a shared machine inflates less) per output is the whole call: prompt processing,
decoding, parsing and validation. A warm-up run per case (canonical, not timed) compiles the
grammar and fills the lazily computed states first; after the constrained run the others go in an
order that rotates per case. Reported per case and summed: seconds per output, the speed-up of
each mode over constrained (target for canonical: >= 1.3x) and over unconstrained (target: > 1),
the share of forced tokens, and whether each mode's parsed object equals constrained greedy's
(verified must be token-identical: checked). The BLAS MLX's CPU matmuls use is reported
(bench/e2e.py's report), with the load average before and after; ratios are from the same run.

With a draft (`--draft-layers N`, the model's first N layers; 0: none) each case also runs with the
draft and fast-forward off, canonical and verified, and the bench prints the draft's acceptance on
free positions (where the grammar forces no byte, so the same positions count in every mode): the
share of their tokens that came from the draft (target: no lower with fast-forward than without).
`--draft-only` runs that part alone.

    python bench/fast_forward.py [--quick] [--draft-layers N] [--draft-only] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import blas_report  # noqa: E402

from grammar_mlx import compile_json_schema  # noqa: E402
from grammar_mlx.generate import generate_structured  # noqa: E402
from grammar_mlx.models import default_model, logits_width_of, truncated_draft  # noqa: E402
from grammar_mlx.runtime.fast_forward import fast_forward_for, tokenizer_encoder  # noqa: E402


def obj(properties: dict, **extra: object) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False, **extra}


def enum(*values: object) -> dict:
    return {"enum": list(values)}


def text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


CASES = [
    ("order", obj({
        "customer_full_name": text(40),
        "shipping_address": obj({"street_line": text(60), "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                                 "country_code": enum("United States", "United Kingdom", "Germany", "France")}),
        "order_status": enum("pending_payment", "processing_shipment", "delivered_to_customer",
                             "cancelled_by_customer"),
        "is_priority_customer": {"type": "boolean"},
        "preferred_contact_method": enum("email_notification", "sms_text_message", "phone_call"),
        "number_of_items": {"type": "integer", "minimum": 1, "maximum": 99}}),
     "Ada Lovelace ordered 3 items, shipped to 12 Baker Street, 10001, United Kingdom; status processing; she is "
     "a priority customer; contact her by email. Reply in JSON.",
     {"customer_full_name": "Ada Lovelace", "shipping_address": {"street_line": "12 Baker Street",
      "postal_code": "10001", "country_code": "United Kingdom"}, "order_status": "processing_shipment",
      "is_priority_customer": True, "preferred_contact_method": "email_notification", "number_of_items": 3}),
    ("employee", obj({
        "employee_full_name": text(40),
        "department_name": enum("engineering_department", "marketing_department", "human_resources", "finance"),
        "employment_status": enum("full_time_employee", "part_time_employee", "contractor"),
        "is_remote_worker": {"type": "boolean"},
        "office_location": obj({"building_name": enum("north_tower", "south_tower", "main_campus"),
                                "floor_number": {"type": "integer", "minimum": 1, "maximum": 50}}),
        "security_clearance_level": enum("public_access", "confidential_access", "secret_access")}),
     "Grace Hopper works full time in engineering, on floor 7 of the north tower, not remotely, with secret "
     "clearance. Reply in JSON.",
     {"employee_full_name": "Grace Hopper", "department_name": "engineering_department",
      "employment_status": "full_time_employee", "is_remote_worker": False,
      "office_location": {"building_name": "north_tower", "floor_number": 7},
      "security_clearance_level": "secret_access"}),
    ("flight", obj({
        "passenger_full_name": text(40),
        "departure_airport_code": enum("JFK", "LHR", "CDG", "FRA", "NRT"),
        "arrival_airport_code": enum("JFK", "LHR", "CDG", "FRA", "NRT"),
        "cabin_class": enum("economy_class", "premium_economy", "business_class", "first_class"),
        "meal_preference": enum("vegetarian_meal", "vegan_meal", "standard_meal", "kosher_meal"),
        "checked_baggage_count": {"type": "integer", "minimum": 0, "maximum": 3},
        "requires_wheelchair_assistance": {"type": "boolean"}}),
     "Alan Turing flies business class from London Heathrow to Tokyo Narita with two checked bags, a vegetarian "
     "meal and no wheelchair. Reply in JSON.",
     {"passenger_full_name": "Alan Turing", "departure_airport_code": "LHR", "arrival_airport_code": "NRT",
      "cabin_class": "business_class", "meal_preference": "vegetarian_meal", "checked_baggage_count": 2,
      "requires_wheelchair_assistance": False}),
    ("ticket", obj({
        "ticket_priority_level": enum("low_priority", "medium_priority", "high_priority", "critical_priority"),
        "affected_product_area": enum("billing_system", "user_authentication", "mobile_application", "reporting"),
        "customer_sentiment": enum("very_negative", "negative", "neutral", "positive"),
        "requires_escalation": {"type": "boolean"},
        "summary_of_issue": text(60),
        "assigned_team": obj({"team_name": enum("platform_team", "payments_team", "mobile_team"),
                              "on_call_engineer": text(30)})}),
     "A very angry customer cannot log in since this morning: user authentication fails. It is high priority and "
     "must be escalated to the mobile team, on call is Linus. Reply in JSON.",
     {"ticket_priority_level": "high_priority", "affected_product_area": "user_authentication",
      "customer_sentiment": "very_negative", "requires_escalation": True, "summary_of_issue": None,
      "assigned_team": {"team_name": "mobile_team", "on_call_engineer": "Linus"}}),
    ("weather", obj({
        "location": obj({"city_name": text(30), "country_code": enum("Norway", "Sweden", "Denmark", "Finland")}),
        "current_conditions": enum("clear_sky", "partly_cloudy", "overcast", "light_rain", "heavy_snow"),
        "temperature_unit": enum("celsius", "fahrenheit"),
        "temperature_value": {"type": "integer", "minimum": -50, "maximum": 60},
        "wind_direction": enum("north", "north_east", "east", "south_east", "south", "south_west", "west",
                               "north_west"),
        "precipitation_expected": {"type": "boolean"}}),
     "Oslo, Norway: light rain, 5 degrees celsius, wind from the south west, more rain expected. Reply in JSON.",
     {"location": {"city_name": "Oslo", "country_code": "Norway"}, "current_conditions": "light_rain",
      "temperature_unit": "celsius", "temperature_value": 5, "wind_direction": "south_west",
      "precipitation_expected": True}),
    ("listing", obj({
        "product_category": enum("consumer_electronics", "home_and_garden", "sporting_goods", "books"),
        "product_condition": enum("brand_new", "used_like_new", "used_good", "refurbished"),
        "shipping_speed": enum("standard_shipping", "express_shipping", "overnight_delivery"),
        "is_gift_wrapped": {"type": "boolean"},
        "warranty": obj({"warranty_provider": enum("manufacturer_warranty", "extended_store_warranty", "none"),
                         "warranty_duration_months": {"type": "integer", "minimum": 0, "maximum": 60}}),
        "price_currency": enum("US_dollar", "euro", "british_pound")}),
     "A refurbished laptop, sent by express shipping, not gift wrapped, with a 12 month manufacturer warranty, "
     "priced in euro. Reply in JSON.",
     {"product_category": "consumer_electronics", "product_condition": "refurbished",
      "shipping_speed": "express_shipping", "is_gift_wrapped": False,
      "warranty": {"warranty_provider": "manufacturer_warranty", "warranty_duration_months": 12},
      "price_currency": "euro"}),
    ("appointment", obj({
        "patient_full_name": text(40),
        "appointment_type": enum("general_checkup", "specialist_consultation", "follow_up_visit", "vaccination"),
        "preferred_time_of_day": enum("early_morning", "late_morning", "afternoon", "evening"),
        "insurance_provider": enum("national_health_service", "private_insurance", "self_pay"),
        "is_first_visit": {"type": "boolean"},
        "referring_physician": obj({"physician_last_name": text(30),
                                    "medical_specialty": enum("cardiology", "dermatology", "neurology")})}),
     "Marie Curie needs a specialist consultation in the afternoon, private insurance, her first visit, referred "
     "by Dr. Bohr, a cardiologist. Reply in JSON.",
     {"patient_full_name": "Marie Curie", "appointment_type": "specialist_consultation",
      "preferred_time_of_day": "afternoon", "insurance_provider": "private_insurance", "is_first_visit": True,
      "referring_physician": {"physician_last_name": "Bohr", "medical_specialty": "cardiology"}}),
    ("vehicle", obj({
        "vehicle_make": enum("Toyota", "Volkswagen", "Volvo", "Renault", "Honda"),
        "fuel_type": enum("petrol_engine", "diesel_engine", "battery_electric", "plug_in_hybrid"),
        "transmission_type": enum("manual_transmission", "automatic_transmission"),
        "number_of_doors": enum(2, 3, 4, 5),
        "registration_region": enum("northern_region", "southern_region", "eastern_region", "western_region"),
        "has_previous_accidents": {"type": "boolean"},
        "owner": obj({"owner_first_name": text(20), "owner_last_name": text(20)})}),
     "A five-door battery electric Volvo with automatic transmission, registered in the western region, no "
     "accidents, owned by Karin Larsson. Reply in JSON.",
     {"vehicle_make": "Volvo", "fuel_type": "battery_electric", "transmission_type": "automatic_transmission",
      "number_of_doors": 5, "registration_region": "western_region", "has_previous_accidents": False,
      "owner": {"owner_first_name": "Karin", "owner_last_name": "Larsson"}}),
]
MODES = ("constrained", "canonical", "verified")


def leaves(value: object, path: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in leaves(item, f"{path}/{key}").items()}
    return {path: value}


def fields_right(value: object, expected: dict) -> tuple[int, int]:
    """(leaves equal to the answer the prompt states, leaves scored): free text (None) is not scored."""
    got, want = leaves(value), {k: v for k, v in leaves(expected).items() if v is not None}
    return sum(got.get(k) == v for k, v in want.items()), len(want)
FAST_FORWARD = {"constrained": False, "canonical": "canonical", "verified": "verified"}


def constrained(model, tokenizer, prompt, schema, mode: str, max_tokens: int) -> dict:
    started, cpu = time.perf_counter(), time.process_time()
    out = generate_structured(model, tokenizer, prompt, schema=schema, max_tokens=max_tokens,
                              fast_forward=FAST_FORWARD[mode])
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "cpu_seconds": time.process_time() - cpu, "tokens": out.stats.generated_tokens,
            "forced": out.stats.forced_tokens,
            "finish": out.stats.finish_reason, "value": out.value, "token_ids": out.token_ids}


def unconstrained(model, tokenizer, prompt_ids: list[int], length: int) -> dict:
    """mlx-lm alone, exactly `length` tokens (EOS masked off: the same length as the constrained output)."""
    from mlx_lm.generate import stream_generate

    eos = sorted(tokenizer.eos_token_ids)

    def no_eos(tokens: mx.array, logits: mx.array) -> mx.array:
        logits[:, eos] = -mx.inf
        return logits

    started, cpu = time.perf_counter(), time.process_time()
    n = sum(1 for _ in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=length,
                                       logits_processors=[no_eos]))
    return {"seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu, "tokens": n}


DRAFT_MODES = ("off", "canonical", "verified")


def draft_acceptance(model, tokenizer, draft, prompt, schema, max_tokens: int, num_draft_tokens: int) -> dict:
    """Per fast-forward mode, with the draft: (free positions, their tokens from the draft, tokens,
    forced tokens, seconds, CPU seconds). A position is free where the grammar forces no byte."""
    grammar = compile_json_schema(schema, tokenizer, logits_width=logits_width_of(model), strict=True)
    ff = fast_forward_for(grammar, tokenizer_encoder(tokenizer))
    out = {}
    for mode in DRAFT_MODES:
        started, cpu = time.perf_counter(), time.process_time()
        result = generate_structured(model, tokenizer, prompt, schema=schema, max_tokens=max_tokens,
                                     fast_forward=False if mode == "off" else mode, draft_model=draft,
                                     num_draft_tokens=num_draft_tokens)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
        state, free, drafted = grammar.initial_state, 0, 0
        for token, from_draft, from_grammar in zip(result.token_ids, result.from_draft, result.from_grammar):
            if not ff.forced_run(state)[0]:
                free += 1
                drafted += bool(from_draft and not from_grammar)
            nxt = grammar.next_state(state, token)
            if nxt < 0:
                break
            state = nxt
        out[mode] = {"free": free, "drafted": drafted, "tokens": len(result.token_ids),
                     "draft_tokens": sum(result.from_draft), "forced": sum(result.from_grammar),
                     "seconds": seconds, "cpu_seconds": cpu_seconds, "token_ids": result.token_ids}
        print(f"  draft, fast-forward {mode}: {drafted}/{free} free positions drafted, {len(result.token_ids)} tokens "
              f"({sum(result.from_grammar)} forced), CPU {cpu_seconds:.1f} s", flush=True)
    return out


def print_draft_table(rows: list[dict]) -> dict:
    print("\ndraft acceptance on free positions (drafted / free; tokens from the draft / tokens; CPU s)")
    print(f"{'case':<12} " + " ".join(f"{m:>30}" for m in DRAFT_MODES))
    for r in rows:
        cells = [f"{d['drafted']:>3}/{d['free']:<3} {d['draft_tokens']:>3}/{d['tokens']:<3} {d['cpu_seconds']:>7.1f}"
                 for d in (r["draft"][m] for m in DRAFT_MODES)]
        print(f"{r['case']:<12} " + " ".join(f"{c:>30}" for c in cells))
    summary = {}
    for m in DRAFT_MODES:
        free = sum(r["draft"][m]["free"] for r in rows)
        drafted = sum(r["draft"][m]["drafted"] for r in rows)
        summary[m] = {"free": free, "drafted": drafted, "acceptance_on_free": drafted / free if free else 0.0,
                      "cpu_seconds": sum(r["draft"][m]["cpu_seconds"] for r in rows),
                      "seconds": sum(r["draft"][m]["seconds"] for r in rows)}
    print("total: " + ", ".join(f"{m} {summary[m]['acceptance_on_free']:.0%} ({summary[m]['drafted']}/"
                                f"{summary[m]['free']}, CPU {summary[m]['cpu_seconds']:.1f} s)" for m in DRAFT_MODES))
    same = sum(r["draft"]["verified"]["token_ids"] == r["draft"]["off"]["token_ids"] for r in rows)
    print(f"with the draft, verified token-identical to off in {same}/{len(rows)}")
    summary["verified_token_identical_to_off"] = same
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two cases only")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--draft-layers", type=int, default=24, help="draft: the model's first N layers (0: none)")
    parser.add_argument("--num-draft-tokens", type=int, default=2)
    parser.add_argument("--draft-only", action="store_true", help="only the draft acceptance part")
    parser.add_argument("--case", action="append", help="only this case (repeatable)")
    parser.add_argument("--out", help="default: bench/results/fast_forward.json (--quick: fast_forward_quick.json)")
    args = parser.parse_args()
    if args.out is None:
        args.out = str(Path(__file__).resolve().parent / "results"
                       / (("fast_forward_draft" if args.draft_only else "fast_forward")
                          + ("_quick.json" if args.quick else ".json")))
    cases = CASES[:2] if args.quick else CASES
    if args.case:
        cases = [c for c in CASES if c[0] in args.case]
    model, tokenizer = default_model()
    draft = truncated_draft(model, args.draft_layers) if args.draft_layers else None
    load_before = os.getloadavg()
    if args.draft_only:
        if draft is None:
            parser.error("--draft-only needs --draft-layers N (N > 0)")
        rows = [{"case": name, "draft": draft_acceptance(model, tokenizer, draft, prompt, schema, args.max_tokens,
                                                         args.num_draft_tokens)} for name, schema, prompt, _ in cases]
        draft_summary = print_draft_table(rows)
        load_after = os.getloadavg()
        print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
        write(args.out, {"draft_summary": draft_summary, "cases": rows, "load_average": [load_before, load_after],
                         "draft_layers": args.draft_layers, "num_draft_tokens": args.num_draft_tokens,
                         "max_tokens": args.max_tokens, "quick": args.quick})
        return
    rows = []
    for i, (name, schema, prompt, expected) in enumerate(cases):
        generate_structured(model, tokenizer, prompt, schema=schema, max_tokens=args.max_tokens)  # warm-up
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        runs: dict[str, dict] = {"constrained": constrained(model, tokenizer, prompt, schema, "constrained",
                                                             args.max_tokens)}
        # The rest in an order that rotates per case, so background load hits none of them alike.
        others = ["canonical", "verified", "unconstrained"]
        for name_ in others[i % 3:] + others[: i % 3]:
            if name_ == "unconstrained":
                runs[name_] = unconstrained(model, tokenizer, prompt_ids, runs["constrained"]["tokens"])
            else:
                runs[name_] = constrained(model, tokenizer, prompt, schema, name_, args.max_tokens)
        base = runs["constrained"]
        row = {"case": name, "prompt_tokens": len(prompt_ids), "constrained_tokens": base["tokens"],
               "unconstrained_seconds": runs["unconstrained"]["seconds"],
               "unconstrained_cpu_seconds": runs["unconstrained"]["cpu_seconds"]}
        for mode in MODES:
            r = runs[mode]
            row[f"{mode}_seconds"] = r["seconds"]
            row[f"{mode}_cpu_seconds"] = r["cpu_seconds"]
            row[f"{mode}_tokens"] = r["tokens"]
            row[f"{mode}_forced"] = r["forced"]
            row[f"{mode}_finish"] = r["finish"]
            row[f"{mode}_same_object"] = r["value"] == base["value"]
            row[f"{mode}_fields_right"], row["fields_scored"] = fields_right(r["value"], expected)
        row["verified_token_identical"] = runs["verified"]["token_ids"] == base["token_ids"]
        row["constrained_value"] = base["value"]
        row["canonical_value"] = runs["canonical"]["value"]
        if draft is not None:
            row["draft"] = draft_acceptance(model, tokenizer, draft, prompt, schema, args.max_tokens,
                                            args.num_draft_tokens)
        rows.append(row)
        print(f"{name}: constrained {base['tokens']} tok {base['seconds']:.1f} s | canonical "
              f"{runs['canonical']['tokens']} tok ({runs['canonical']['forced']} forced) "
              f"{runs['canonical']['seconds']:.1f} s | verified {runs['verified']['seconds']:.1f} s | "
              f"unconstrained {runs['unconstrained']['seconds']:.1f} s", flush=True)
    load_after = os.getloadavg()

    def total(key: str) -> float:
        return sum(r[key] for r in rows)

    def per_token(seconds: str, tokens: str) -> float:
        return total(seconds) / total(tokens)

    summary = {
        "cases": len(rows),
        "seconds": {m: total(f"{m}_seconds") for m in (*MODES, "unconstrained")},
        "speedup_over_constrained": {m: total("constrained_seconds") / total(f"{m}_seconds") for m in MODES},
        "speedup_over_unconstrained": {m: total("unconstrained_seconds") / total(f"{m}_seconds") for m in MODES},
        "cpu_seconds": {m: total(f"{m}_cpu_seconds") for m in (*MODES, "unconstrained")},
        "cpu_speedup_over_constrained": {m: total("constrained_cpu_seconds") / total(f"{m}_cpu_seconds")
                                         for m in MODES},
        "cpu_speedup_over_unconstrained": {m: total("unconstrained_cpu_seconds") / total(f"{m}_cpu_seconds")
                                           for m in MODES},
        "forced_share": {m: total(f"{m}_forced") / total(f"{m}_tokens") for m in MODES},
        # Outputs differ in length between modes (plain greedy sometimes writes a longer value):
        # seconds per output token, against unconstrained's at the constrained length.
        "per_token_speedup_over_constrained": {
            m: per_token("constrained_seconds", "constrained_tokens") / per_token(f"{m}_seconds", f"{m}_tokens")
            for m in MODES},
        "per_token_speedup_over_unconstrained": {
            m: per_token("unconstrained_seconds", "constrained_tokens") / per_token(f"{m}_seconds", f"{m}_tokens")
            for m in MODES},
        "same_object_as_constrained": {m: sum(r[f"{m}_same_object"] for r in rows) for m in MODES},
        "verified_token_identical": sum(r["verified_token_identical"] for r in rows),
        "fields_right": {m: total(f"{m}_fields_right") for m in MODES}, "fields_scored": total("fields_scored"),
        "all_stop": all(r[f"{m}_finish"] == "stop" for r in rows for m in MODES),
    }
    header = (f"{'case':<12} {'tokens':>6} {'constr s':>8} {'canon s':>8} {'verif s':>8} {'uncon s':>8} "
              f"{'canon x':>7} {'verif x':>7} {'canon/uncon':>11} {'forced':>7} {'same obj':>8} right c/c/of")
    print("\n" + header)
    for r in rows:
        print(f"{r['case']:<12} {r['constrained_tokens']:>6} {r['constrained_seconds']:>8.2f} "
              f"{r['canonical_seconds']:>8.2f} {r['verified_seconds']:>8.2f} {r['unconstrained_seconds']:>8.2f} "
              f"{r['constrained_seconds'] / r['canonical_seconds']:>6.2f}x "
              f"{r['constrained_seconds'] / r['verified_seconds']:>6.2f}x "
              f"{r['unconstrained_seconds'] / r['canonical_seconds']:>10.2f}x "
              f"{r['canonical_forced'] / r['canonical_tokens']:>7.0%} "
              f"{'yes' if r['canonical_same_object'] else 'no':>8} "
              f"{r['constrained_fields_right']:>3}/{r['canonical_fields_right']}/{r['fields_scored']}")
    s = summary
    print(f"{'total':<12} {int(total('constrained_tokens')):>6} {s['seconds']['constrained']:>8.2f} "
          f"{s['seconds']['canonical']:>8.2f} {s['seconds']['verified']:>8.2f} {s['seconds']['unconstrained']:>8.2f} "
          f"{s['speedup_over_constrained']['canonical']:>6.2f}x {s['speedup_over_constrained']['verified']:>6.2f}x "
          f"{s['speedup_over_unconstrained']['canonical']:>10.2f}x {s['forced_share']['canonical']:>7.0%} "
          f"{s['same_object_as_constrained']['canonical']:>4}/{len(rows)}")
    print(f"verified: token-identical to constrained in {s['verified_token_identical']}/{len(rows)}, "
          f"forced share {s['forced_share']['verified']:.0%}, {s['speedup_over_unconstrained']['verified']:.2f}x "
          f"unconstrained; every output finished on EOS: {s['all_stop']}")
    print(f"per output token: canonical {s['per_token_speedup_over_constrained']['canonical']:.2f}x constrained, "
          f"{s['per_token_speedup_over_unconstrained']['canonical']:.2f}x unconstrained "
          f"({total('canonical_tokens'):.0f} tokens against {total('constrained_tokens'):.0f})")
    print(f"CPU time (less sensitive to other load): canonical {s['cpu_speedup_over_constrained']['canonical']:.2f}x "
          f"constrained, {s['cpu_speedup_over_unconstrained']['canonical']:.2f}x unconstrained; verified "
          f"{s['cpu_speedup_over_constrained']['verified']:.2f}x constrained")
    print(f"fields equal to the prompt's answer: constrained {s['fields_right']['constrained']:.0f}, canonical "
          f"{s['fields_right']['canonical']:.0f}, verified {s['fields_right']['verified']:.0f} of "
          f"{s['fields_scored']:.0f}")
    if draft is not None:
        summary["draft"] = print_draft_table(rows)
    blas = blas_report()
    print(f"BLAS: {blas['active']}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    write(args.out, {"summary": summary, "cases": rows, "blas": blas, "load_average": [load_before, load_after],
                     "max_tokens": args.max_tokens, "quick": args.quick, "draft_layers": args.draft_layers,
                     "num_draft_tokens": args.num_draft_tokens})


def write(path: str, result: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
