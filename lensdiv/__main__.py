"""``python -m lensdiv`` runs the command line."""

from lensdiv.cli import main

main()
