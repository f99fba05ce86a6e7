"""lightning_megatrain: train causal LMs larger than GPU memory on one GPU with ``Trainer(strategy="megatrain")``.

Importing the package registers ``"megatrain"`` in Lightning's strategy registry (Lightning has no entry-point
discovery for strategies) and the ``"packed_sdpa"`` attention in transformers' (see [Note: packed attention] in
``models/packed_attention.py``), and shows the package's INFO messages (layout, kept layers, host memory) the way
Lightning shows its own: on stderr unless the application configured logging itself.
"""

import logging

from lightning.pytorch.strategies import StrategyRegistry

from lightning_megatrain.engine.step_guard import NonFiniteError, StepFailed
from lightning_megatrain.models import packed_attention
from lightning_megatrain.precision import MegaTrainPrecision
from lightning_megatrain.strategy import MegaTrainStrategy

_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():  # as lightning.pytorch does for its logger
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

if MegaTrainStrategy.strategy_name not in StrategyRegistry:
    MegaTrainStrategy.register_strategies(StrategyRegistry)
packed_attention.register()

__all__ = ["MegaTrainPrecision", "MegaTrainStrategy", "NonFiniteError", "StepFailed"]
__version__ = "0.1.0"
