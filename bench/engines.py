"""One harness for the schema benchmarks (bench/compile.py, bench/fidelity.py): ours, llguidance and
xgrammar, each in its own persistent worker process, through the same code path.

Each engine's tokenizer state is built in the parent (ours: the Vocabulary and its token trie;
llguidance: its tokenizer; xgrammar: TokenizerInfo and a 1-thread GrammarCompiler, cache off); a worker
is forked once from there, in its own session, and warmed with one small schema. The parent sends it
one request at a time and waits; the worker times its work with perf_counter. A request not answered
within the timeout is a timeout: the parent kills the worker's whole process group (ours' compile
pool with it) and forks a fresh, warmed one. Engines run one after another per schema, never at once.

Requests:
- ("compile", schema_text): compile the schema and compute the initial state's mask. The reply:
  `first_mask_s` (time to first mask), `compiled`, `exact` (the engine claims to enforce every keyword:
  see each engine's `exact` below), `note` (why not exact / the error), engine details.
- ("check", [token ids, ...]): for the grammar compiled last, whether each token sequence is accepted:
  every token consumed and the grammar accepting (EOS allowed) at the end.
- ("sample", (byte tokens, text token limit, seeds)): for the grammar compiled last, one
  `random_walk` per seed (the same walk rule for every engine): the token ids, None where a walk
  got stuck or ran past its length.

What "exact" means per engine:
- ours: `grammar.unenforced` is empty (the compiler lists every keyword it cannot enforce exactly).
- llguidance: the matcher has no error. llguidance refuses a schema with a keyword it does not
  implement ("Unimplemented keys: [...]", oneOf without `coerce_one_of`, an unknown format): it errors,
  it does not ignore it, so for llguidance "compiled" and "claims exact" are the same thing.
- xgrammar: compiled and wrote no warning on stderr. xgrammar warns for the approximations it knows
  (`multipleOf` on numbers, overlapping `oneOf` read as `anyOf`) but silently ignores other keywords
  (uniqueItems, not, contains, dependencies, if/then...), so its exact claim is an upper bound: the
  invalid instances it accepts where it claims exact show the gap.
"""

from __future__ import annotations

import importlib.machinery
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import types
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked from the parent

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

QWEN_WIDTH = 151_936
WARM_SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 8},
                                                           "b": {"type": "array", "items": {"type": "integer"}}},
                          "required": ["a"]})


def load_qwen() -> Any:
    """The genuine Qwen3 tokenizer (Hugging Face, fast)."""
    from conftest import qwen_tokenizer_dir
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(qwen_tokenizer_dir()))


def torch_stand_in() -> types.ModuleType:
    """Enough of a `torch` module for `import xgrammar` (its tensor helpers are never called here)."""

    class StandIn(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            value = (lambda *a, **k: None) if name.islower() else type(name, (), {})
            setattr(self, name, value)
            return value

    torch = StandIn("torch")
    torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    return torch


def import_xgrammar() -> Any:
    try:
        import torch  # noqa: F401
    except ImportError:
        import tvm_ffi  # noqa: F401 - before the stand-in, so it sees no torch

        sys.modules["torch"] = torch_stand_in()
    import xgrammar

    return xgrammar


# --- engines: set up in the parent, used in the worker ----------------------------------------------


class Engine:
    name = ""

    def version(self) -> str:
        raise NotImplementedError

    def first_mask(self, schema_text: str) -> dict[str, Any]:
        """Compile + the initial mask; keeps what `accepts` needs. The reply's fields (see the module)."""
        raise NotImplementedError

    def accepts(self, ids: list[int]) -> bool:
        raise NotImplementedError

    # A random walk over the single-byte tokens (sampled outputs): start, the next bytes allowed
    # (and whether the text so far is complete), take one.
    def walk_start(self) -> None:
        raise NotImplementedError

    def walk_next(self, byte_tokens: list[int]) -> tuple[list[int], bool]:
        raise NotImplementedError

    def walk_take(self, token: int) -> None:
        raise NotImplementedError

    def walk_all(self) -> list[int]:
        """Every token the last `walk_next` allowed."""
        raise NotImplementedError


class Ours(Engine):
    """`compile_json_schema(text, vocabulary, logits_width=, use_cache=False, mode=)`: mode "auto" is what
    the server compiles with (its other options are the request's whitespace / strict / open_objects,
    here their defaults, and its on-disk cache, here off)."""

    def __init__(self, tokenizer: Any, width: int, mode: str = "auto", timeout: float = 30.0,
                 open_objects: bool = False):
        import grammar_mlx as gm
        from grammar_mlx.compiler import build

        self.gm, self.build = gm, build
        self.vocab = gm.vocabulary_of(tokenizer)
        self.width, self.mode, self.timeout, self.open_objects = width, mode, timeout, open_objects
        # The vocabulary's state, built once before forking (as llguidance's tokenizer is): its trie
        # and the trie's string slice (which the first lazy grammar of a process builds otherwise).
        build.token_trie(self.vocab, width).string_slice()
        self.name = "ours" if mode == "auto" else f"ours-{mode}"
        if open_objects:
            self.name += "-open"
        self.grammar: Any = None

    def version(self) -> str:
        return str(self.gm.__version__)

    def first_mask(self, schema_text: str) -> dict[str, Any]:
        self.grammar = None
        self.build._LIVE.clear()
        started = time.perf_counter()
        try:
            grammar = self.gm.compile_json_schema(schema_text, self.vocab, logits_width=self.width, use_cache=False,
                                                  mode=self.mode, timeout=self.timeout,
                                                  open_objects=self.open_objects)
            grammar.mask_row(grammar.initial_state)
            grammar.device_masks()
        except self.gm.GrammarError as exc:
            timeout = isinstance(exc, self.gm.CompileTimeoutError)
            return {"first_mask_s": time.perf_counter() - started, "compiled": False, "exact": False,
                    "timeout": timeout, "note": f"{type(exc).__name__}: {exc}"[:300]}
        seconds = time.perf_counter() - started
        self.grammar = grammar
        unenforced = [f"{u.keyword} at {u.pointer or '/'}" for u in grammar.unenforced]
        return {"first_mask_s": seconds, "compiled": True, "exact": not unenforced,
                "note": "; ".join(unenforced)[:300], "mode": grammar.stats.get("mode"),
                "engine": grammar.stats.get("engine")}

    def accepts(self, ids: list[int]) -> bool:
        return bool(self.grammar.matches(ids))

    def walk_start(self) -> None:
        self.state = self.grammar.initial_state

    def walk_next(self, byte_tokens: list[int]) -> tuple[list[int], bool]:
        g, state = self.grammar, self.state
        return [b for b, t in enumerate(byte_tokens) if g.next_state(state, t) >= 0], bool(g.is_accepting(state))

    def walk_take(self, token: int) -> None:
        self.state = self.grammar.next_state(self.state, token)

    def walk_all(self) -> list[int]:
        return [int(t) for t in self.grammar.allowed_tokens(self.state)]


class LLGuidance(Engine):
    """`LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})` +
    `LLMatcher(tokenizer, grammar)` + one `fill_next_token_bitmask`."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, width: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp

        self.llg, self.lnp = llguidance, lnp
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=width)
        self.bitmask = lnp.allocate_token_bitmask(1, self.tokenizer.vocab_size)  # as xgrammar's: outside the timing
        self.matcher: Any = None

    def version(self) -> str:
        from importlib.metadata import version

        return version("llguidance")

    def first_mask(self, schema_text: str) -> dict[str, Any]:
        self.matcher = None
        started = time.perf_counter()
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema_text,
                                                                  defaults={"whitespace_flexible": False})
            matcher = self.llg.LLMatcher(self.tokenizer, grammar)
            self.lnp.fill_next_token_bitmask(matcher, self.bitmask, 0)
        except Exception as exc:  # noqa: BLE001 - an error is a schema it does not compile
            return {"first_mask_s": time.perf_counter() - started, "compiled": False, "exact": False,
                    "note": f"{type(exc).__name__}: {exc}"[:300]}
        seconds = time.perf_counter() - started
        if matcher.is_error():
            return {"first_mask_s": seconds, "compiled": False, "exact": False, "note": matcher.get_error()[:300]}
        self.matcher = matcher
        warnings = matcher.get_grammar_warnings()
        return {"first_mask_s": seconds, "compiled": True, "exact": True, "note": "; ".join(warnings)[:300]}

    def accepts(self, ids: list[int]) -> bool:
        self.matcher.reset()
        consumed = self.matcher.try_consume_tokens(ids)
        ok = consumed == len(ids) and not self.matcher.is_error() and self.matcher.is_accepting()
        self.matcher.reset()
        return bool(ok)

    def walk_start(self) -> None:
        self.matcher.reset()

    def walk_next(self, byte_tokens: list[int]) -> tuple[list[int], bool]:
        self.lnp.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        return allowed_bytes(self.bitmask, byte_tokens), bool(self.matcher.is_accepting())

    def walk_take(self, token: int) -> None:
        self.matcher.consume_token(token)

    def walk_all(self) -> list[int]:
        return all_allowed(self.bitmask)


class XGrammar(Engine):
    """`GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(text,
    any_whitespace=False, separators=(",", ":"))` + `GrammarMatcher` + one `fill_next_token_bitmask`;
    stderr is captured around the compile for its fallback warnings."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, width: int):
        self.xgr = import_xgrammar()
        info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=width)
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = np.zeros((1, -(-width // 32)), dtype=np.int32)
        self.matcher: Any = None

    def version(self) -> str:
        from importlib.metadata import version

        return version("xgrammar")

    def first_mask(self, schema_text: str) -> dict[str, Any]:
        self.matcher = None
        with tempfile.TemporaryFile() as captured:
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(captured.fileno(), 2)
            started = time.perf_counter()
            try:
                compiled = self.compiler.compile_json_schema(schema_text, any_whitespace=False,
                                                             separators=(",", ":"))
                matcher = self.xgr.GrammarMatcher(compiled)
                matcher.fill_next_token_bitmask(self.bitmask, 0)
                error = None
            except Exception as exc:  # noqa: BLE001 - an error is a schema it does not compile
                error = f"{type(exc).__name__}: {exc}"[:300]
            seconds = time.perf_counter() - started
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            warnings = captured.read().decode(errors="replace").strip()
        if error is not None:
            return {"first_mask_s": seconds, "compiled": False, "exact": False, "note": error}
        self.matcher = matcher
        return {"first_mask_s": seconds, "compiled": True, "exact": not warnings,
                "note": " | ".join(line.split("Warning: ")[-1] for line in warnings.splitlines())[:300]}

    def accepts(self, ids: list[int]) -> bool:
        self.matcher.reset()
        with tempfile.TemporaryFile() as captured:  # a rejected token is logged on stderr: keep it quiet
            saved = os.dup(2)
            os.dup2(captured.fileno(), 2)
            try:
                ok = all(self.matcher.accept_token(t) for t in ids) and self.matcher.is_completed()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        self.matcher.reset()
        return bool(ok)

    def walk_start(self) -> None:
        self.matcher.reset()

    def walk_next(self, byte_tokens: list[int]) -> tuple[list[int], bool]:
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return allowed_bytes(self.bitmask, byte_tokens), bool(self.matcher.is_completed())

    def walk_take(self, token: int) -> None:
        self.matcher.accept_token(token)

    def walk_all(self) -> list[int]:
        return all_allowed(self.bitmask)


def allowed_bytes(bitmask: np.ndarray, byte_tokens: list[int]) -> list[int]:
    """The bytes whose single-byte token a (1, ceil(V/32)) int32 bitmask allows."""
    words = bitmask.reshape(-1).view(np.uint32)
    return [b for b, t in enumerate(byte_tokens) if (int(words[t >> 5]) >> (t & 31)) & 1]


def all_allowed(bitmask: np.ndarray) -> list[int]:
    bits = np.unpackbits(bitmask.reshape(-1).view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits)]


PRINTABLE = frozenset(range(0x20, 0x7F))
CLOSERS = frozenset(b'"]}')
WALK_STEPS = 1500


def random_walk(engine: Engine, byte_tokens: list[int], text_limit: int, seed: int) -> list[int] | None:
    """A seeded random walk of the engine's grammar, the same rule for every engine: where the text is
    complete, stop with probability 1/2; else one of the single-byte tokens allowed, uniformly from the
    printable ASCII ones (any allowed byte where none is), a closing `"`, `]` or `}` with probability
    0.3 where one is allowed (0.8 after 300 steps) so walks end; where no single byte is allowed
    (llguidance allows only the canonical token where its grammar forces bytes), any allowed text
    token (id below `text_limit`). The token ids; None: stuck or too long."""
    import random

    rng = random.Random(seed)
    engine.walk_start()
    out: list[int] = []
    for step in range(WALK_STEPS):
        allowed, complete = engine.walk_next(byte_tokens)
        if complete and (not allowed or rng.random() < 0.5):
            return out
        pool = [b for b in allowed if b in PRINTABLE] or allowed
        if pool:
            closers = [b for b in pool if b in CLOSERS]
            if closers and rng.random() < (0.3 if step < 300 else 0.8):
                pool = closers
            token = byte_tokens[rng.choice(pool)]
        else:
            tokens = [t for t in engine.walk_all() if t < text_limit]
            if not tokens:
                return out if complete else None
            token = rng.choice(tokens)
        engine.walk_take(token)
        out.append(token)
    return None


def make_engines(names: list[str], tokenizer: Any, width: int, timeout: float) -> list[Engine]:
    """The engines by name: ours (mode auto, as the server), ours-lazy, ours-open (open_objects),
    llguidance, xgrammar. An optional peer that fails to load is reported and left out."""
    made: list[Engine] = []
    for name in names:
        try:
            if name == "ours":
                made.append(Ours(tokenizer, width, "auto", timeout + 10))
            elif name == "ours-lazy":
                made.append(Ours(tokenizer, width, "lazy", timeout + 10))
            elif name == "ours-open":
                made.append(Ours(tokenizer, width, "auto", timeout + 10, open_objects=True))
            elif name == "llguidance":
                made.append(LLGuidance(tokenizer, width))
            elif name == "xgrammar":
                made.append(XGrammar(tokenizer, width))
            else:
                raise ValueError(f"unknown engine {name!r}")
        except ImportError as exc:
            print(f"{name} unavailable: {exc}"[:200], file=sys.stderr)
    return made


# --- the worker process and its handle in the parent ------------------------------------------------


def _serve(engine: Engine, conn: Connection, warm: bool = True) -> None:
    os.setsid()  # its own process group: a timeout kills ours' compile pool with it
    try:
        if warm:
            engine.first_mask(WARM_SCHEMA)
        conn.send(("ready", None))
        while True:
            kind, payload = conn.recv()
            if kind == "compile":
                conn.send(("ok", engine.first_mask(payload)))
            elif kind == "check":
                conn.send(("ok", [engine.accepts(ids) for ids in payload]))
            elif kind == "sample":
                byte_tokens, text_limit, seeds = payload
                conn.send(("ok", [random_walk(engine, byte_tokens, text_limit, seed) for seed in seeds]))
            else:
                return
    except (EOFError, KeyboardInterrupt):
        return
    except BaseException as exc:  # noqa: BLE001 - a crash is reported, the parent respawns
        conn.send(("error", f"{type(exc).__name__}: {exc}"[:300]))


class Worker:
    """The parent's handle on one engine's worker process. `fresh`: a fresh child per schema, forked
    from the parent (tokenizer state built, nothing compiled, no warm-up schema) and ended after its
    answers, so each schema meets the process as an unseen one meets a new server process;
    `name` is then the engine's name + "@fresh"."""

    def __init__(self, engine: Engine, fresh: bool = False):
        self.engine = engine
        self.fresh = fresh
        self.name = engine.name + ("@fresh" if fresh else "")
        self.process: Any = None
        self.conn: Connection | None = None
        self.respawns = 0

    def start(self) -> None:
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(self.engine, child, not self.fresh), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(300) or self.conn.recv()[0] != "ready":
            raise RuntimeError(f"{self.engine.name}: the worker did not start")

    def kill(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.join()
        assert self.conn is not None
        self.conn.close()
        self.process = self.conn = None

    def call(self, kind: str, payload: Any, timeout: float) -> tuple[str, Any]:
        """("ok", reply) / ("timeout", None) / ("error", text): a timeout or a crash respawns the worker."""
        if self.process is None:
            self.start()
        assert self.conn is not None
        self.conn.send((kind, payload))
        try:
            if self.conn.poll(timeout):
                status, value = self.conn.recv()
                if status == "ok":
                    return status, value
            else:
                status, value = "timeout", None
        except EOFError:
            status, value = "error", f"the worker died (exit {self.process.exitcode})"
        self.kill()
        self.respawns += 1
        return status, value

    def close(self) -> None:
        if self.process is not None and self.conn is not None:
            try:
                self.conn.send(("stop", None))
            except OSError:
                pass
        self.kill()


# --- shared helpers -------------------------------------------------------------------------------

CORPUS = REPO.parent / "shared" / "corpora" / "maskbench-public.jsonl.gz"


def stratified_sample(per_subset: int, seed: int, n: int | None = None) -> list[dict[str, Any]]:
    """`per_subset` schemas of every subset (all of a smaller one), seeded; in round-robin order over
    the subsets, so the first `n` are a smaller stratified sample."""
    import gzip
    import random

    by_subset: dict[str, list[dict[str, Any]]] = {}
    with gzip.open(CORPUS, "rt") as f:
        for line in f:
            row = json.loads(line)
            by_subset.setdefault(row["subset"], []).append(row)
    rng = random.Random(seed)
    picks = {name: rng.sample(rows, min(per_subset, len(rows))) for name, rows in sorted(by_subset.items())}
    longest = max(map(len, picks.values()), default=0)  # not per_subset: --all passes a huge one
    ordered = [picks[name][i] for i in range(longest) for name in sorted(picks) if i < len(picks[name])]
    return ordered[:n] if n else ordered


def whole_corpus(only: set[str] | None = None) -> list[dict[str, Any]]:
    """Every schema of the corpus (those whose id is in `only`, when given), in round-robin order over
    the subsets (seeded shuffles within each: a run cut short is still stratified)."""
    return [row for row in stratified_sample(10**9, 0) if only is None or row["id"] in only]


def schema_text(row: dict[str, Any]) -> str:
    return row["schema"] if isinstance(row["schema"], str) else json.dumps(row["schema"])


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    if not values:
        return None
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 2)


def start_workers(engines: list[Engine], schemas: int, started: float, load: tuple[float, ...],
                  processes: tuple[str, ...] = ("warm",)) -> list[Worker]:
    """A worker per engine and process kind ("warm": persistent; "fresh": a child per schema, see
    `Worker`), the warm ones started, and the set-up line both benchmarks print."""
    workers = [Worker(e, fresh=kind == "fresh") for kind in processes for e in engines]
    for w in workers:
        if not w.fresh:
            w.start()
    print(f"set-up {time.perf_counter() - started:.1f} s; engines {versions(engines)}; {schemas} schemas; "
          f"load average {load}", flush=True)
    return workers


def versions(engines: list[Engine]) -> dict[str, str]:
    return {e.name: e.version() for e in engines}


def measure(workers: list[Worker], text: str, timeout: float, instances: list[list[int]] | None = None,
            walks: tuple[list[int], int, list[int]] | None = None, first: int = 0) -> dict[str, dict[str, Any]]:
    """Each engine in turn (never two at once), starting with `workers[first % len(workers)]` (callers
    pass the schema's index: the worker that runs right after the previous schema's, its fresh children
    killed and the machine's caches cold, is a different one each schema, not always the first):
    compile `text` and the first mask within `timeout`;
    then, when `instances` are given and it compiled, which of them it accepts, and when `walks`
    (byte tokens, text token limit, seeds) are, its random walks (each within `timeout` again). {engine: its reply,
    with `status` "ok" / "timeout" / "error", `accepted` and `walks`}."""
    out: dict[str, dict[str, Any]] = {}
    start = first % len(workers)
    for worker in workers[start:] + workers[:start]:
        status, reply = worker.call("compile", text, timeout)
        if status != "ok":
            reply = {"compiled": False, "exact": False, "first_mask_s": None,
                     "note": "timeout" if status == "timeout" else reply}
        elif reply.pop("timeout", False):  # the engine's own deadline (ours): a timeout as well
            status = "timeout"
        reply["status"] = status
        if instances is not None and reply["compiled"]:
            checked, accepted = worker.call("check", instances, timeout)
            reply["accepted"] = accepted if checked == "ok" else None
            if checked != "ok":
                reply["check_failed"] = checked if checked == "timeout" else accepted
        if walks is not None and reply["compiled"] and "check_failed" not in reply:
            walked, texts = worker.call("sample", walks, timeout)
            reply["walks"] = texts if walked == "ok" else None
            if walked != "ok":
                reply["walks_failed"] = walked if walked == "timeout" else texts
        out[worker.name] = reply
        if worker.fresh:
            worker.kill()
    return out
