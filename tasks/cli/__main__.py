"""``python -m tasks.cli`` runs the corral command."""

from tasks.cli import main

raise SystemExit(main())
