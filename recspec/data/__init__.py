"""Interactions, side information, dataset loaders and train/validation/test splits."""

from recspec.data.dataset import Dataset, Interactions, ItemInfo, UserInfo
from recspec.data.loaders import FORMATS, load_dataset
from recspec.data.splits import Examples, SplitData, split_dataset

__all__ = [
    "FORMATS",
    "Dataset",
    "Examples",
    "Interactions",
    "ItemInfo",
    "SplitData",
    "UserInfo",
    "load_dataset",
    "split_dataset",
]
