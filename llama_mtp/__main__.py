"""``python -m llama_mtp`` = the ``llama-mtp`` command."""

from .cli import main

main()
