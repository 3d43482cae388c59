"""Regular expressions as syntax: character sets (`charset`), the one character-level AST
(`syntax`), and the two dialects parsed into it: ECMA-262, JSON Schema's `pattern` (`ecma`), and
Rust regex-automata, what users and the schema front end hand to the compiler (`rust`, for the byte
NFA). Imports only `grammar_mlx.errors` and `grammar_mlx.limits` (and, for the Unicode tables of the
Rust dialect, `automata.byte_dfa` lazily).
"""
