"""``python -m lightning_megatrain``: the ``megatrain`` command."""

from lightning_megatrain.cli import main

raise SystemExit(main())
