"""`python -m grammar_mlx generate|compile`: see `grammar_mlx.cli`."""

import sys

from .cli import main

sys.exit(main())
