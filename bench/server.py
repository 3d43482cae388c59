"""Throughput and latency of `grammar_mlx.server` on loopback with the embedded SmolLM2.

For each server (no draft; `--draft-layers N` truncated draft) and each number of concurrent clients,
the same chat prompt is sent unconstrained and with a `json_schema` response_format, once per
`--fast-forward` mode (the request's `"fast_forward"`: canonical, verified, off), in alternating
rounds (so that load from other processes hits all alike). Per cell: requests/s, p50/p95 latency,
completion tokens/s, the server process's CPU seconds per completion token (its own user + system
time over the cell, from /proc), and the ratios constrained / unconstrained per fast-forward mode
measured in the same run, each beside its ceiling on this machine (`forward_cost`, `ceiling`: the
shares of tokens forced and sampled from a head computed at a sparse grammar row's ids alone, both
from `usage`, and what a step costs here, bound how far a constrained reply can go). Tokens/s
is the fairer ratio: an unconstrained reply may be longer or shorter than the JSON one (both are
capped by the same `--max-tokens`). Every constrained reply that finished is checked against its
schema. With one client, the answers with the draft are compared with those without (greedy: they
must be equal). Then, on the server without a draft: the time to refuse a 10 MB body, a small
request's latency while such bodies are refused back to back vs alone, and the time from SIGTERM
to exit with a stream in flight.

Bounded: `--requests` per cell (split over `--rounds`), `--cell-seconds` per cell, `--total-seconds`
for the whole run (cells past it are skipped and reported as such); servers are stopped at the end.

    python bench/server.py [--clients 1,4] [--requests 4] [--max-tokens 24] [--draft-layers 24]
                           [--fast-forward canonical,off] [--schema color|person] [--out server.json]

`--tool-calls`: instead, tool-call latency on a tiny random-weight qwen3 model directory with the
genuine Qwen3 tokenizer and chat template (tests/conftest.py's `write_tiny_qwen3_dir`; its speed says
what the constraint costs around a model, not what a real model takes): streamed requests with
`tools`, per mode the time to the first SSE event, to the whole answer, and per token. Modes:
`tool_choice: required` (the call constrained), `auto` steered to the call by `logit_bias`
(constrained once triggered), the prompt without tools on our server (unconstrained), and the floor:
plain `mlx_lm.server` on the same directory, unconstrained, made to generate as many tokens as the
constrained call took (a random model never stops by itself). mlx-lm sends a tool call as one delta
when it ends, so for the call modes the first event is the whole call. Writes
bench/results/server-tools.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

COLOR = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "color", "ok"],
    "additionalProperties": False,
}
COLOR_MESSAGES = [{"role": "user", "content": "Reply with a JSON object: a short name, a color and whether it is ok."}]
# `--schema person`: the 8-field person object of issue 24's measurement (more keys for fast-forward to force).
PERSON = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string", "maxLength": 16},
        "last_name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 32},
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16},
        "occupation": {"type": "string", "maxLength": 16},
        "married": {"type": "boolean"},
    },
    "required": ["first_name", "last_name", "age", "email", "city", "country", "occupation", "married"],
    "additionalProperties": False,
}
PERSON_MESSAGES = [{"role": "user", "content": "Describe a fictional person as a JSON object."}]


class Workload(NamedTuple):
    """What the requests ask: the constrained ones' schema, and every request's messages."""

    schema: dict
    messages: list[dict]


WORKLOADS = {"color": Workload(COLOR, COLOR_MESSAGES), "person": Workload(PERSON, PERSON_MESSAGES)}
FAST_FORWARD = {"canonical": "canonical", "verified": "verified", "off": False}  # the request's "fast_forward"


class Server:
    def __init__(self, *options: str, max_tokens: int):
        self.log = open(os.devnull, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grammar_mlx.server", "--host", "127.0.0.1", "--port", "0", "--log-level",
             "WARNING", "--no-preload-json-object", "--max-tokens", str(max_tokens), *options],
            cwd=REPO, stdout=subprocess.PIPE, stderr=self.log)
        deadline = time.monotonic() + 180
        line = b""
        while not line.endswith(b"\n"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise SystemExit(f"server {options} did not start")
            if select.select([self.proc.stdout], [], [], 1.0)[0]:
                line += os.read(self.proc.stdout.fileno(), 4096)
        self.url = re.search(rb"(http://127\.0\.0\.1:\d+)", line).group(1).decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU seconds so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request(url: str, work: Workload, mode: str, max_tokens: int, timeout: float) -> dict:
    """mode: "unconstrained", or "constrained <fast-forward mode>"."""
    body: dict = {"model": "smollm", "messages": work.messages, "max_tokens": max_tokens}
    if mode != "unconstrained":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": work.schema, "strict": True}}
        body["fast_forward"] = FAST_FORWARD[mode.split()[1]]
    data = json.dumps(body).encode()
    started = time.perf_counter()
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            reply = json.load(r)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None
    latency = time.perf_counter() - started
    choice = reply["choices"][0]
    details = reply["usage"].get("completion_tokens_details") or {}
    return {"latency": latency, "tokens": reply["usage"]["completion_tokens"], "finish": choice["finish_reason"],
            "forced": details.get("forced_tokens", 0), "sparse": details.get("sparse_head_tokens"),
            "text": choice["message"]["content"] or ""}


# The ids of the sparse head timed for the ceiling: a grammar's sparse rows in these workloads (a
# key's quote, a digit, a boolean) allow a few dozen at most.
SPARSE_IDS = 32


def forward_cost(work: Workload, repeats: int = 9) -> dict:
    """This machine's cost of one decode step on the embedded model, measured in this process before
    any server starts, after the workload's prompt (bench/device_check.py's `decode_step_ms`: B rows
    fed W tokens each, the head read at each row's last position) at (B, W) = (1, 1), (1, 4), (4, 1),
    fitted as `step + head·B + per_position·B·W` ms, and at (1, 1) with the head at SPARSE_IDS ids
    (`sparse_saving`: what that saves). A forced token saves its head and a share of a step and
    still costs a position, a token sampled at a sparse grammar row saves `sparse_saving`, so the
    tokens/s constrained replies can reach over unconstrained ones is bounded by `ceiling(step /
    clients, head, per_position, forced share, sparse share, sparse_saving)`: the bound `ratios`
    print beside the measured ratio."""
    from device_check import decode_step_ms

    from grammar_mlx.models import default_model

    model, tokenizer = default_model()
    prompt = tokenizer.apply_chat_template(work.messages, add_generation_prompt=True)
    medians = decode_step_ms(model, prompt, [(1, 1), (1, 4), (4, 1), (1, 1, SPARSE_IDS)], repeats)
    per_position = (medians[1, 4] - medians[1, 1]) / 3
    head = (medians[4, 1] - medians[1, 4]) / 3
    return {"step_ms": medians[1, 1] - per_position - head, "head_ms": head, "per_position_ms": per_position,
            "sparse_saving_ms": medians[1, 1] - medians[1, 1, SPARSE_IDS],
            "measured_ms": {" ".join(f"{k}={v}" for k, v in zip("BWK", shape)): t for shape, t in medians.items()}}


def ceiling(step: float, head: float, per_position: float, forced_share: float, sparse_share: float,
            sparse_saving: float) -> float:
    """The most tokens/s replies can reach over ones decoded token by token with the whole head, when
    `forced_share` of their tokens is fast-forwarded and `sparse_share` sampled from a head computed
    at a sparse row's ids alone: a sampled token costs `step` + `head` + `per_position`, a forced one
    `per_position` alone, a sparse one `sparse_saving` less than a sampled one, and nothing else
    costs."""
    whole = step + head + per_position
    return whole / (whole - forced_share * (step + head) - sparse_share * sparse_saving)


def post_raw(url: str, data: bytes, timeout: float = 120) -> int:
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def fault_figures(url: str, work: Workload, max_tokens: int) -> dict:
    """A 10 MB body (over the embedded model's 1 MiB default limit): how long its 413 takes, and what
    it does to a small request served meanwhile (latency with refusals sent back to back vs alone)."""
    huge = json.dumps({"messages": [{"role": "user", "content": "x " * 5_000_000}]}).encode()
    started = time.perf_counter()
    status = post_raw(url, huge)
    refuse_s = time.perf_counter() - started
    alone = [request(url, work, "unconstrained", max_tokens, timeout=300)["latency"] for _ in range(2)]
    stop = threading.Event()
    refused = [0]

    def hammer() -> None:
        while not stop.is_set():
            post_raw(url, huge)
            refused[0] += 1

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        during = [request(url, work, "unconstrained", max_tokens, timeout=300)["latency"] for _ in range(2)]
    finally:
        stop.set()
        thread.join()
    return {"huge_body_status": status, "huge_body_bytes": len(huge), "refuse_s": refuse_s,
            "small_alone_s": statistics.median(alone), "small_during_refusals_s": statistics.median(during),
            "refusals_meanwhile": refused[0],
            "during_over_alone": statistics.median(during) / statistics.median(alone)}


def sigterm_seconds(server: Server, work: Workload, max_tokens: int) -> float:
    """Seconds from SIGTERM to the process's exit with a streamed request in flight."""
    body = json.dumps({"model": "smollm", "messages": work.messages, "max_tokens": max(max_tokens, 200),
                       "stream": True}).encode()
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        while b'"content"' not in r.readline():  # tokens are arriving
            pass
        started = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        r.read()
        server.proc.wait(60)
        return time.perf_counter() - started


def valid(text: str, schema: dict) -> bool:
    try:
        instance = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(instance, dict) and set(instance) == set(schema["required"])
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def run_cell(url: str, work: Workload, mode: str, clients: int, count: int, deadline: float,
             max_tokens: int) -> tuple[list, float]:
    """`count` requests over `clients` threads (each sends its next one when the last returns)."""
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    issued = [0]

    def client() -> None:
        while True:
            with lock:
                if issued[0] >= count or time.monotonic() > deadline:
                    return
                issued[0] += 1
            try:
                r = request(url, work, mode, max_tokens, timeout=max(deadline - time.monotonic(), 1) + 60)
            except (OSError, RuntimeError) as e:
                with lock:
                    errors.append(str(e))
                return
            with lock:
                results.append(r)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return results, wall


def summarize(results: list[dict], wall: float) -> dict:
    if not results:
        return {"requests": 0}
    latencies = sorted(r["latency"] for r in results)
    tokens = sum(r["tokens"] for r in results)

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, round(p * (len(latencies) - 1)))]

    return {
        "requests": len(results),
        "seconds": wall,
        "requests_per_s": len(results) / wall,
        "p50_s": pct(0.50),
        "p95_s": pct(0.95),
        "tokens_per_s": tokens / wall,
        "mean_tokens": tokens / len(results),
        "finish": {f: sum(r["finish"] == f for r in results) for f in {r["finish"] for r in results}},
    }


TOOL = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}}}
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]
TOOL_CALL_ID = 151657  # Qwen3's <tool_call>


def streamed_request(url: str, body: dict, timeout: float = 300) -> dict:
    """One streamed chat request: seconds to the first data event and to [DONE], completion tokens,
    the tool calls reassembled from their deltas."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    first = None
    tokens, calls, finish = 0, [], None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            if first is None:
                first = time.perf_counter() - started
            if line.strip() == b"data: [DONE]":
                break
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                calls += [c["function"] for c in choice.get("delta", {}).get("tool_calls") or []]
                finish = choice.get("finish_reason") or finish
    return {"first_s": first, "whole_s": time.perf_counter() - started, "tokens": tokens, "calls": calls,
            "finish": finish}


def wait_health(url: str, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def tool_call_latency(args: argparse.Namespace) -> int:
    import socket
    import tempfile

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import write_tiny_qwen3_dir

    model_dir = write_tiny_qwen3_dir(Path(tempfile.mkdtemp(prefix="bench-tiny-qwen3-")) / "model")
    ours = Server("--model", str(model_dir), max_tokens=args.max_tokens)
    with socket.socket() as probe:  # a free port for mlx_lm.server, which has no --port 0
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    floor = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--host",
                              "127.0.0.1", "--port", str(port), "--max-tokens", str(args.max_tokens)],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    floor_url = f"http://127.0.0.1:{port}"
    base = {"model": "default_model", "messages": TOOL_MESSAGES, "tools": [TOOL], "max_tokens": args.max_tokens,
            "chat_template_kwargs": {"enable_thinking": False}}
    modes = {
        "required (constrained)": (ours.url, {**base, "tool_choice": "required", "parallel_tool_calls": False}),
        "auto + logit_bias (constrained)": (ours.url, {**base, "logit_bias": {str(TOOL_CALL_ID): 100},
                                                      "parallel_tool_calls": False}),
    }
    rows: dict[str, list[dict]] = {}
    try:
        wait_health(floor_url, floor)
        for url, body in modes.values():  # warm-up: grammar compile, prompt cache
            streamed_request(url, body)
        call_tokens = streamed_request(*modes["required (constrained)"])["tokens"]
        unconstrained = {**base, "max_tokens": call_tokens}
        modes["no tools (ours, unconstrained)"] = (ours.url, {**unconstrained, "tools": None})
        modes["mlx_lm.server (floor)"] = (floor_url, unconstrained)
        for url, body in list(modes.values())[2:]:
            streamed_request(url, body)
        for _ in range(args.requests):  # alternating, so that load from other processes hits all alike
            for name, (url, body) in modes.items():
                rows.setdefault(name, []).append(streamed_request(url, body))
    finally:
        ours.stop()
        if floor.poll() is None:
            floor.send_signal(signal.SIGTERM)
            try:
                floor.wait(30)
            except subprocess.TimeoutExpired:
                floor.kill()
                floor.wait()
    summary = {}
    for name, results in rows.items():
        summary[name] = {
            "requests": len(results),
            "first_s": statistics.median(r["first_s"] for r in results),
            "whole_s": statistics.median(r["whole_s"] for r in results),
            "tokens": statistics.median(r["tokens"] for r in results),
            "ms_per_token": 1000 * statistics.median(r["whole_s"] / max(r["tokens"], 1) for r in results),
            "calls": statistics.median(len(r["calls"]) for r in results),
            "finish": sorted({str(r["finish"]) for r in results}),
        }
    floor_row = summary["mlx_lm.server (floor)"]
    print(f"{'mode':<34} {'reqs':>4} {'first s':>8} {'whole s':>8} {'tokens':>6} {'ms/tok':>7} {'calls':>5}  finish")
    for name, row in summary.items():
        print(f"{name:<34} {row['requests']:>4} {row['first_s']:>8.3f} {row['whole_s']:>8.3f} {row['tokens']:>6.0f} "
              f"{row['ms_per_token']:>7.2f} {row['calls']:>5.0f}  {','.join(row['finish'])}")
    print("\nvs mlx_lm.server unconstrained, same tokens (same run):")
    for name, row in summary.items():
        print(f"  {name:<34} whole x{row['whole_s'] / floor_row['whole_s']:.2f}, "
              f"ms/token x{row['ms_per_token'] / floor_row['ms_per_token']:.2f}")
    bad = [r for name in modes if name.endswith("(constrained)") for r in rows[name] if len(r["calls"]) != 1]
    print(f"constrained requests without exactly one call: {len(bad)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "server-tools.json"
    out.write_text(json.dumps({
        "model": "tiny random-weight qwen3 (64 hidden, 2 layers, float32) + genuine Qwen3 tokenizer",
        "summary": summary, "rows": rows, "args": vars(args),
        "environment": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(),
                        "platform": platform.platform()},
    }, indent=2))
    print(f"wrote {out}")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,4", help="comma-separated concurrent client counts (1,4)")
    parser.add_argument("--requests", type=int, default=4, help="requests per cell and mode (4)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per cell (2)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--draft-layers", type=int, default=24,
                        help="truncated draft (24 of 30 layers); 0: no draft run")
    parser.add_argument("--num-draft-tokens", type=int, default=2)
    parser.add_argument("--cell-seconds", type=float, default=120, help="time for one cell, both modes (120)")
    parser.add_argument("--total-seconds", type=float, default=600, help="time for the whole run (600)")
    parser.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a 10 MB body's refusal, a request served meanwhile, and SIGTERM (on)")
    parser.add_argument("--fast-forward", default="canonical,off",
                        help="comma-separated fast-forward modes of the constrained requests (canonical,off)")
    parser.add_argument("--schema", choices=sorted(WORKLOADS), default="color",
                        help="the constrained requests' schema and the prompt: color (3 fields) or person (8)")
    parser.add_argument("--out", default="server.json", help="results file under bench/results (server.json)")
    parser.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                        help="first fit this machine's decode step cost and print each ratio's ceiling (on)")
    parser.add_argument("--tool-calls", action="store_true",
                        help="only the tool-call latency on a tiny qwen3 directory (see above)")
    args = parser.parse_args()
    work = WORKLOADS[args.schema]
    if args.tool_calls:
        return tool_call_latency(args)
    clients_list = [int(c) for c in args.clients.split(",")]
    fast_forwards = args.fast_forward.split(",")
    unknown = set(fast_forwards) - set(FAST_FORWARD)
    if unknown:
        parser.error(f"--fast-forward: unknown {sorted(unknown)}; choose from {sorted(FAST_FORWARD)}")
    modes = ("unconstrained", *(f"constrained {f}" for f in fast_forwards))
    run_started = time.monotonic()
    configs = [("none", ())] + ([(f"{args.draft_layers} layers", ("--draft-layers", str(args.draft_layers),
                                                                  "--num-draft-tokens", str(args.num_draft_tokens)))]
                                if args.draft_layers else [])
    cost = forward_cost(work) if args.ceiling else None
    if cost:
        print(f"decode step on this machine: {cost['step_ms']:.0f} ms + {cost['head_ms']:.0f} ms per row sampled + "
              f"{cost['per_position_ms']:.0f} ms per position fed, {cost['sparse_saving_ms']:.0f} ms less for a row "
              f"sampled at {SPARSE_IDS} ids ("
              + ", ".join(f"{k}: {v:.0f} ms" for k, v in cost["measured_ms"].items()) + ")")
    rows = []
    invalid = 0
    answers: dict[str, list[str]] = {}  # single-client answers in order, per draft: greedy, so they must agree
    faults: dict = {}
    for draft_name, options in configs:
        if time.monotonic() - run_started > args.total_seconds:
            rows.append({"draft": draft_name, "skipped": "total time budget spent"})
            continue
        server = Server(*options, max_tokens=args.max_tokens)
        try:
            for mode in modes:  # warm-up: grammar compile, prompt cache, first-use kernels
                request(server.url, work, mode, args.max_tokens, timeout=300)
            for clients in clients_list:
                if time.monotonic() - run_started > args.total_seconds:
                    rows.append({"draft": draft_name, "clients": clients, "skipped": "total time budget spent"})
                    continue
                per_round = max(1, args.requests // args.rounds)
                # Each (round, mode) slice gets its share of the cell's time, so neither mode starves the other.
                slice_seconds = args.cell_seconds / (args.rounds * len(modes))
                collected = {m: ([], 0.0, 0.0) for m in modes}
                for _ in range(args.rounds):
                    for mode in modes:
                        deadline = time.monotonic() + slice_seconds
                        cpu_before = cpu_seconds(server.proc.pid)
                        results, wall = run_cell(server.url, work, mode, clients, per_round, deadline, args.max_tokens)
                        cpu_after = cpu_seconds(server.proc.pid)
                        cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else 0.0
                        prior, prior_wall, prior_cpu = collected[mode]
                        collected[mode] = (prior + results, prior_wall + wall, prior_cpu + cpu)
                if clients == 1:
                    answers[draft_name] = [r["text"] for m in modes for r in collected[m][0]]
                for mode in modes:
                    results, wall, cpu = collected[mode]
                    if mode != "unconstrained":
                        bad = [r["text"] for r in results
                               if r["finish"] == "stop" and not valid(r["text"], work.schema)]
                        invalid += len(bad)
                    summary = summarize(results, wall)
                    if results:
                        tokens = max(sum(r["tokens"] for r in results), 1)
                        summary["server_cpu_ms_per_token"] = 1000 * cpu / tokens
                        summary["forced_share"] = sum(r["forced"] for r in results) / tokens
                        sparse = [r["sparse"] for r in results]
                        # Counted where fast-forward is on (usage has no count with it off).
                        summary["sparse_share"] = None if None in sparse else sum(sparse) / tokens
                    rows.append({"draft": draft_name, "clients": clients, "mode": mode, **summary})
            if args.faults and draft_name == "none":
                faults = fault_figures(server.url, work, args.max_tokens)
                faults["sigterm_to_exit_s"] = sigterm_seconds(server, work, args.max_tokens)
        finally:
            server.stop()

    def find(draft, clients, mode):
        return next((r for r in rows if r.get("draft") == draft and r.get("clients") == clients
                     and r.get("mode") == mode and r.get("requests")), None)

    ratios = []
    for draft_name, _ in configs:
        for clients in clients_list:
            u = find(draft_name, clients, "unconstrained")
            for fast_forward in fast_forwards:
                c = find(draft_name, clients, f"constrained {fast_forward}")
                if u and c:
                    ratios.append({"draft": draft_name, "clients": clients, "fast_forward": fast_forward,
                                   "requests_per_s": c["requests_per_s"] / u["requests_per_s"],
                                   "tokens_per_s": c["tokens_per_s"] / u["tokens_per_s"],
                                   "p50": c["p50_s"] / u["p50_s"], "forced_share": c["forced_share"],
                                   "sparse_share": c["sparse_share"],
                                   "tokens_per_s_ceiling": ceiling(cost["step_ms"] / clients, cost["head_ms"],
                                                                   cost["per_position_ms"], c["forced_share"],
                                                                   c["sparse_share"], cost["sparse_saving_ms"])
                                   if cost and c["sparse_share"] is not None else None})

    print(f"{'draft':<10} {'clients':>7} {'mode':<22} {'reqs':>4} {'req/s':>7} {'p50 s':>7} {'p95 s':>7} "
          f"{'tok/s':>7} {'tok/req':>7} {'cpu ms/tok':>10}  finish")
    for r in rows:
        if "skipped" in r or not r["requests"]:
            print(f"{r['draft']:<10} {r.get('clients', ''):>7} {r.get('mode', ''):<22} "
                  f"skipped: {r.get('skipped', 'no request finished within the cell time')}")
            continue
        print(f"{r['draft']:<10} {r['clients']:>7} {r['mode']:<22} {r['requests']:>4} {r['requests_per_s']:>7.3f} "
              f"{r['p50_s']:>7.2f} {r['p95_s']:>7.2f} {r['tokens_per_s']:>7.2f} {r['mean_tokens']:>7.1f} "
              f"{r['server_cpu_ms_per_token']:>10.1f}  {r['finish']}")
    print("\nconstrained / unconstrained (same run):")
    for q in ratios:
        print(f"  draft {q['draft']:<10} clients {q['clients']} fast-forward {q['fast_forward']:<9}: "
              f"req/s x{q['requests_per_s']:.2f}, "
              f"tok/s x{q['tokens_per_s']:.2f}, p50 latency x{q['p50']:.2f}, forced {q['forced_share']:.0%}"
              + (f", sparse head {q['sparse_share']:.0%}" if q["sparse_share"] is not None else "")
              + (f" (tok/s ceiling x{q['tokens_per_s_ceiling']:.2f})" if q["tokens_per_s_ceiling"] else ""))
    print(f"constrained replies that finished but failed their schema: {invalid}")
    exact = None
    if len(answers) == 2:
        plain, drafted = answers.values()
        exact = {"equal": sum(a == b for a, b in zip(plain, drafted)), "compared": min(len(plain), len(drafted))}
        print(f"single-client answers with the draft equal to those without: {exact['equal']}/{exact['compared']}")
    if faults:
        print(f"10 MB body: HTTP {faults['huge_body_status']} in {faults['refuse_s'] * 1000:.0f} ms; a small request "
              f"{faults['small_alone_s']:.2f} s alone, {faults['small_during_refusals_s']:.2f} s while "
              f"{faults['refusals_meanwhile']} such bodies were refused (x{faults['during_over_alone']:.2f}); "
              f"SIGTERM with a stream in flight: exit in {faults['sigterm_to_exit_s']:.2f} s")

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / args.out
    out.write_text(json.dumps({
        "rows": rows, "ratios": ratios, "decode_step_cost": cost, "invalid_constrained": invalid,
        "draft_exactness": exact, "faults": faults,
        "args": vars(args),
        "environment": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(),
                        "platform": platform.platform()},
        "seconds": time.monotonic() - run_started,
    }, indent=2))
    print(f"wrote {out}")
    return 1 if invalid or (exact and exact["equal"] != exact["compared"]) else 0


if __name__ == "__main__":
    sys.exit(main())
