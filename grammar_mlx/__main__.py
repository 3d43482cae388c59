"""`python -m grammar_mlx generate|compile|serve`: see `grammar_mlx.cli`."""

import sys

from .cli import main

sys.exit(main())
