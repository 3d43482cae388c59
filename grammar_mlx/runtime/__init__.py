"""Following a generation: the versioned state stack (`stack`), the history follower that turns
mlx-lm's `(tokens, logits)` calls into pushes and rollbacks (`stateful`), and the logits processors
built on it (`processor.GrammarProcessor`; `stateful`'s penalty processor), and
fast-forward (`fast_forward`: the text a grammar forces, as the tokenizer's canonical tokens).
Imports `kernels`, `errors`, `arguments` and `limits` only: a grammar is read through the protocols
`stack.StackGrammar` and `processor.MaskedGrammar` (a compiled grammar and a segment grammar have
both).
"""

from .processor import GrammarProcessor, MaskedGrammar
from .stack import StackGrammar, StateStack, walk, walk_to
from .stateful import HistoryFollower, PenaltyProcessor, StatefulProcessor

__all__ = ["GrammarProcessor", "HistoryFollower", "MaskedGrammar", "PenaltyProcessor", "StackGrammar", "StateStack",
           "StatefulProcessor", "walk", "walk_to"]
