"""Data: loaders, batch structure, and sharding a loader's order across ranks.

>>> from unison.data import DataLoaders, DistributedDL, to_device
"""

from unison.data.batch import DataLoaders, to_device
from unison.data.loader import DistributedDL

__all__ = ["DataLoaders", "DistributedDL", "to_device"]
