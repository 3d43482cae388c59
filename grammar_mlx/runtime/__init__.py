"""Following a generation: the versioned state stack (`stack`), the history follower that turns
mlx-lm's `(tokens, logits)` calls into pushes and rollbacks (`stateful`), and the logits processors
built on it (`processor.GrammarProcessor`; `stateful`'s thinking-budget and penalty processors).
Imports `compiler` (for the grammar interface), `kernels`, `errors`.
"""

from .processor import GrammarProcessor
from .stack import StateStack
from .stateful import HistoryFollower, PenaltyProcessor, StatefulProcessor, ThinkingBudgetProcessor

__all__ = ["GrammarProcessor", "StateStack", "HistoryFollower", "StatefulProcessor", "ThinkingBudgetProcessor",
           "PenaltyProcessor"]
