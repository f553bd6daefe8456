"""``python -m corral.cli`` runs the corral command."""

from corral.cli import main

raise SystemExit(main())
