"""`python -m grammar_mlx.server ...`: the same as `python -m grammar_mlx serve ...`."""

import sys

from .serve import main

sys.exit(main())
