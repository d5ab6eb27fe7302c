"""``python -m ppo_fast`` runs the ``ppo-fast`` command."""

import sys

from .cli import main

sys.exit(main())
