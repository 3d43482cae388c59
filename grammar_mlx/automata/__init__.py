"""Finite automata. `byte_dfa`: `ByteDFA`, the one byte-automaton type (a DFA over UTF-8 bytes by
byte class, complete or built on demand), and outlines-core's DFA of a regex read into it through
the NUL sentinel; `byte_nfa`: a regex's UTF-8 byte NFA and its on-demand determinization into a
`ByteDFA`, which the compiler walks token by token; `chars`: character-level DFAs over code points
that the schema front end intersects, subtracts and writes back as regexes (pattern x format x
length, key languages) — a different job, never walked by bytes. Imports `regex`, `errors`,
`limits` (outlines-core lazily); `byte_dfa` imports only numpy and `errors` (the compile worker
loads it without the package's `__init__`).
"""
