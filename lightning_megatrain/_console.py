"""Lightning console lines the ``megatrain`` command leaves out: ones that tell a user nothing they can act on.

- ``TPU available: False, using: 0 TPU cores``: printed at every fit on a machine without a TPU (the strategy trains
  on one CUDA GPU or the CPU). ``GPU available: ..., used: ...`` stays: it says whether the GPU is used. A
  ``TPU available: True`` line stays too.
- ``💡 Tip: For seamless cloud logging ... litlogger ...``: an advertisement printed at every fit whose loggers
  include no ``LitLogger``.
- The ``FutureWarning`` "``isinstance(treespec, LeafSpec)`` is deprecated" that torch raises when
  ``lightning.pytorch.utilities._pytree`` builds a ``LeafSpec`` (Lightning's own code, not the user's).

Library use (``Trainer(strategy="megatrain")`` in a script) keeps Lightning's output as it is.
"""

from __future__ import annotations

import logging
import warnings

# Lightning's rank_zero_info goes through this logger (lightning.pytorch.utilities.rank_zero sets it as the log of
# lightning_utilities' rank_zero module).
LIGHTNING_INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"
DROPPED_PREFIXES = ("TPU available: False, using: 0 TPU cores", "💡 Tip: For seamless cloud logging")


class _DropNoise(logging.Filter):
    """Drops the records whose message starts with one of :data:`DROPPED_PREFIXES`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(DROPPED_PREFIXES)


def quiet_lightning() -> None:
    """Leave the lines listed in the module docstring out of the console (idempotent)."""
    logger = logging.getLogger(LIGHTNING_INFO_LOGGER)
    if not any(isinstance(existing, _DropNoise) for existing in logger.filters):
        logger.addFilter(_DropNoise())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
