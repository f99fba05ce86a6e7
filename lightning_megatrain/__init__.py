"""lightning_megatrain: train causal LMs larger than GPU memory on one GPU with ``Trainer(strategy="megatrain")``.

Importing the package registers ``"megatrain"`` in Lightning's strategy registry (Lightning has no entry-point
discovery for strategies).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_megatrain.precision import MegaTrainPrecision
from lightning_megatrain.strategy import MegaTrainStrategy

if MegaTrainStrategy.strategy_name not in StrategyRegistry:
    MegaTrainStrategy.register_strategies(StrategyRegistry)

__all__ = ["MegaTrainPrecision", "MegaTrainStrategy"]
__version__ = "0.1.0"
