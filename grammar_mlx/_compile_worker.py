"""The compile worker: builds a grammar's token tables in a child process.

outlines-core builds its token index in Rust without a way to interrupt it, and pathological
grammars (a `maxLength: 300` string over a 150k vocabulary) run for minutes or eat all memory. So the
build runs here, in a separate process that the parent can kill at its deadline, under a memory
limit, while the parent stays responsive. This file imports only numpy and outlines-core (no mlx,
no grammar_mlx) so the worker starts in ~0.1 s; the parent runs it as a script.

Protocol over stdin/stdout: length-prefixed pickles. Parent → worker: `("vocab", fingerprint,
eos_id, text_tokens)` once per vocabulary, then `("build", job)`. Worker → parent: any number of
`("progress", stage, done, total)` then `("done", meta)` or `("error", kind, message)`.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time

import numpy as np

_HEADER = struct.Struct("<Q")


def send(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(stream, size: int) -> bytes:
    # The parent reads an unbuffered pipe (so that select() sees every byte), where reads may be short.
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(stream):
    (size,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return pickle.loads(_read_exact(stream, size))


def classify_index_error(message: str) -> str:
    """Map an outlines-core error message to the name of the grammar_mlx error class."""
    if "incompatible with the regex" in message:
        return "VocabularyMismatchError"
    if "Failed to build DFA" in message or "regex" in message.lower() and "parse" in message.lower():
        return "InvalidRegexError"
    if "empty" in message.lower():
        return "EmptyLanguageError"
    return "GrammarError"


# outlines-core 0.2.14 drops every token edge that leaves an accepting DFA state for a non-accepting
# one (regex-automata reports matches one byte late, and its index mistakes "a match ended before this
# byte" for "this edge ends in a match"): `0(x1)?` compiles to accept only "0", `(ab)?` only "". So we
# never let the user's regex match before its end: we compile `(?:R)\x00` with one extra token, the
# sentinel (a fake id whose bytes are "\x00"; real tokens containing NUL are left out, no valid JSON
# or text grammar needs them). R's accepting states are exactly those whose sentinel edge reaches an
# outlines final state; sentinel edges are then dropped.
SENTINEL_ID = 2**31 - 1
SENTINEL_BYTES = b"\x00"


def wrap_regex(regex: str) -> str:
    return f"(?:{regex})\\x00"


class BuildError(Exception):
    """A build failure the parent turns into the named grammar_mlx error class."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def build_tables(index, eos_ids: list[int], logits_width: int, progress=lambda *a: None) -> tuple[dict, dict]:
    """Dense tables from an outlines-core Index of `wrap_regex(R)`.

    States reachable from the initial state are renumbered 0..S-2 (in outlines' id order), plus a
    terminal state S-1 entered by any EOS from an accepting state, whose only allowed tokens are the
    EOS ids. Transitions are CSR: `offsets[s]:offsets[s+1]` slices `tokens` (sorted) and `next`.
    Masks are deduplicated rows.
    """
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    initial = index.get_initial_state()
    eos = np.array(sorted(set(eos_ids)), dtype=np.int64)
    empty = (np.empty(0, np.int64), np.empty(0, np.int64))

    edges: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    accepting_ids: set[int] = set()
    for sid, row in transitions.items():
        if row.get(SENTINEL_ID) in finals:
            accepting_ids.add(sid)
        tok = np.fromiter(row.keys(), dtype=np.int64, count=len(row))
        nxt = np.fromiter(row.values(), dtype=np.int64, count=len(row))
        keep = (tok != SENTINEL_ID) & (tok < logits_width) & ~np.isin(tok, eos)
        edges[sid] = (tok[keep], nxt[keep])

    reachable, frontier = {initial}, [initial]
    while frontier:
        sid = frontier.pop()
        for n in np.unique(edges.get(sid, empty)[1]).tolist():
            if n not in reachable:
                reachable.add(n)
                frontier.append(n)
    if not reachable & accepting_ids:
        raise BuildError("EmptyLanguageError", "the grammar accepts no string that the vocabulary can produce")
    stuck = [s for s in reachable if s not in accepting_ids and len(edges.get(s, empty)[0]) == 0]
    if stuck:
        raise BuildError("VocabularyMismatchError",
                         "the grammar needs text that no token can produce (e.g. a NUL character)")

    outlines_ids = np.array(sorted(reachable), dtype=np.int64)
    num_states = len(outlines_ids) + 1
    terminal = num_states - 1
    accepting = np.zeros(num_states, dtype=bool)
    accepting[np.searchsorted(outlines_ids, sorted(reachable & accepting_ids))] = True
    accepting[terminal] = True

    rows_tok, rows_next = [], []
    for i, sid in enumerate(outlines_ids.tolist()):
        tok, nxt = edges.get(sid, empty)
        nxt = np.searchsorted(outlines_ids, nxt)
        if accepting[i]:
            tok = np.concatenate([tok, eos])
            nxt = np.concatenate([nxt, np.full(len(eos), terminal)])
        order = np.argsort(tok, kind="stable")
        rows_tok.append(tok[order].astype(np.int32))
        rows_next.append(nxt[order].astype(np.int32))
    rows_tok.append(eos.astype(np.int32))
    rows_next.append(np.full(len(eos), terminal, dtype=np.int32))
    progress("tables", 1, 2)

    counts = np.array([len(r) for r in rows_tok], dtype=np.int64)
    offsets = np.zeros(num_states + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    tokens = np.concatenate(rows_tok)
    nexts = np.concatenate(rows_next)

    words = -(-logits_width // 32)
    mask_rows: dict[bytes, int] = {}
    unique: list[np.ndarray] = []
    mask_id = np.empty(num_states, dtype=np.int32)
    bits = np.zeros(words * 32, dtype=bool)
    for s in range(num_states):
        bits[:] = False
        bits[rows_tok[s]] = True
        packed = np.packbits(bits, bitorder="little").view("<u4")
        key = packed.tobytes()
        row = mask_rows.get(key)
        if row is None:
            row = mask_rows[key] = len(unique)
            unique.append(packed)
        mask_id[s] = row
        if s % 256 == 0:
            progress("masks", s, num_states)
    masks = np.stack(unique).astype(np.uint32)
    arrays = {
        "offsets": offsets,
        "tokens": tokens,
        "next": nexts,
        "accepting": accepting,
        "masks": masks,
        "mask_id": mask_id,
    }
    meta = {
        "initial_state": int(np.searchsorted(outlines_ids, initial)),
        "terminal_state": terminal,
        "num_transitions": int(len(tokens)),
        "mask_bytes_before_dedup": int(num_states * words * 4),
        "mask_bytes": int(masks.nbytes),
    }
    return arrays, meta


def _set_memory_limit(limit_bytes: int) -> None:
    if limit_bytes <= 0:
        return
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    except (ImportError, ValueError, OSError):  # not enforceable here (e.g. macOS): the deadline still holds
        pass


def serve(stdin, stdout) -> None:
    from outlines_core import Index, Vocabulary

    # cache.py is a plain module without package-relative imports, so it loads as a sibling file.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cache

    vocabularies: dict[str, tuple] = {}
    while True:
        try:
            message = receive(stdin)
        except EOFError:
            return
        if message[0] == "vocab":
            _, fingerprint, eos_id, text_tokens = message
            vocabularies.clear()  # one live vocabulary at a time keeps the worker's memory bounded
            text_tokens = {b: ids for b, ids in text_tokens.items() if SENTINEL_BYTES not in b}
            text_tokens[SENTINEL_BYTES] = [SENTINEL_ID]
            vocabularies[fingerprint] = Vocabulary(eos_id, text_tokens)
            continue
        job = message[1]
        try:
            started = time.perf_counter()
            index = Index(wrap_regex(job["regex"]), vocabularies[job["fingerprint"]])
            index_seconds = time.perf_counter() - started
            send(stdout, ("progress", "index", 1, 1))
            arrays, meta = build_tables(
                index, job["eos_ids"], job["logits_width"], lambda *a: send(stdout, ("progress", *a))
            )
            meta["index_seconds"] = index_seconds
            meta["build_seconds"] = time.perf_counter() - started
            cache.write_tables(job["path"], job["key"], arrays, meta)
            send(stdout, ("done", meta))
        except BuildError as exc:
            send(stdout, ("error", exc.kind, str(exc)))
        except MemoryError:
            send(stdout, ("error", "GrammarTooLargeError", "the grammar's tables exceeded the compile memory limit"))
        except Exception as exc:  # reported to the parent, which raises the typed error
            send(stdout, ("error", classify_index_error(str(exc)), str(exc)))


if __name__ == "__main__":
    _set_memory_limit(int(os.environ.get("GRAMMAR_MLX_WORKER_MEMORY", "0")))
    # The protocol owns the original stdout; anything a library prints goes to stderr instead.
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, protocol_out)
